"""Expert parallelism: the ``expert_parallel`` style (docs/moe.md).

A mixture-of-experts module in transformers 5 holds its routed experts as parameters
``[num_experts, ...]`` (``gate_up_proj``, ``down_proj``, gpt-oss's biases) and is called as
``experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])``. Under this
style each of the ``ep`` ranks keeps ``num_experts / ep`` consecutive experts, held as
DTensors ``Shard(0)`` on the ep mesh: the parameter keeps its full-model name and shape, so
checkpoints are keyed per expert of the whole model and resume on any ep, and FSDP2 shards
the local experts again over the ``efsdp`` ranks (its 2-D DTensor path, as for TP).

The router stays outside, on each rank's own tokens. Dispatch is dropless:

1. each rank counts its (token, expert) pairs per expert and exchanges the counts
   (``all_to_all_single``), so every rank knows how many rows it will receive;
2. the pairs, sorted by expert, go to the rank owning the expert with a variable-size
   differentiable all-to-all (``all_to_all_single_autograd``);
3. the module's own forward (any of transformers' experts implementations) runs on what
   arrived, with its local experts and a weight of one per row;
4. the rows come back by the reverse all-to-all, are multiplied by the router's weights on
   the rank that routed them (so the router's gradient is computed where the router ran)
   and summed per token.

An expert id outside ``[0, num_experts)`` raises at run time: it is never dropped.

gpt-oss names the three arguments ``(hidden_states, router_indices, routing_weights)``; Llama
4's experts take every token for every expert instead (``experts(hidden_states [E·T, H])``),
spread by :func:`tpplan.parallel.experts.forms.dense_forward`. A list of per-expert modules
called in the routed form: :mod:`tpplan.parallel.experts.module_list`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from ..._torch.modules import own_parameters
from ...plan.errors import ErrorList
from ...plan.specs import MeshSpec, Rule
from ...plan.styles import EP_STYLES
from .forms import (call_form, computes_aux_loss, dense_forward, expert_count, experts_for_ep,
                    positional_call, tie_experts, using_local_experts)
from .module_list import check_expert_list, check_rules_inside_lists, split_expert_list
from .sequence_local import check_sequence_local

__all__ = ["ExpertParallel", "check_aux_loss", "computes_aux_loss", "check_expert_parallel",
           "expert_count",
           "local_expert_params", "call_form", "experts_for_ep", "expert_tp_inside_ep",
           "dispatch_counts", "balanced_counts", "balanced_routing", "check_experts",
           "routed_forward"]

_balanced = [0]  # how many balanced_routing() blocks are open


def local_expert_params(module: nn.Module) -> list[str]:
    """The names of the parameters the style splits over ep (all the module's own)."""
    return [n for n, p in module.named_parameters(recurse=False)]


def check_expert_parallel(rule: Rule, path: str, module: nn.Module, ep: int,
                          errs: ErrorList, parent: nn.Module | None = None) -> None:
    """Whether ``rule`` (``expert_parallel``) fits ``module`` (whose parent is ``parent``) at
    ``ep``; errors at the rule."""
    where = f"module '{path}' ({type(module).__name__})"
    if isinstance(module, nn.ModuleList):
        return check_expert_list(rule, path, module, ep, errs, parent)
    n = expert_count(module)
    if n is None:
        errs.add(f"{where} is not an experts container: expert_parallel needs a module with "
                 "an integer 'num_experts' and its own parameters shaped [num_experts, ...] "
                 "(transformers 5's experts classes, e.g. 'model.layers.*.mlp.experts')",
                 rule.loc)
        return
    if call_form(module) is None:
        try:
            names = list(inspect.signature(module.forward).parameters)
        except (TypeError, ValueError):
            names = []
        errs.add(f"{where}'s forward takes ({', '.join(names) or 'something else'}): "
                 "expert_parallel calls experts with three tensors by position (hidden states "
                 "[T, H], expert ids [T, k], routing weights [T, k]; any names, further "
                 "arguments only with defaults), or one (every token for every expert)", rule.loc)
    if n % ep:
        errs.add(f"{where} holds {n} experts and mesh ep={ep} does not divide them", rule.loc)


def expert_tp_inside_ep(first: Rule, second: Rule) -> str:
    """The reason two rules on one experts module cannot both hold, when one is
    ``expert_parallel`` and the other a tp style (else nothing to add)."""
    styles = {first.style.name, second.style.name}
    if not (styles & set(EP_STYLES) and styles - set(EP_STYLES)):
        return ""
    return ("; expert TP inside EP (the experts split over tp too) is not supported: with "
            "tp > 1 expert_parallel keeps each expert whole on its rank (beside tp, or borrowing "
            "tp's ranks under sequence_local; docs/moe.md), so give the experts one rule")


def balanced_counts(pairs: int, num_experts: int) -> list[int]:
    """(token, expert) pairs per expert under balanced routing (the first experts take the
    remainder): what the dry run assumes, having no expert ids to count."""
    return [pairs // num_experts + (e < pairs % num_experts) for e in range(num_experts)]


@contextlib.contextmanager
def balanced_routing() -> Iterator[None]:
    """Inside it, ``expert_parallel`` routes as if each expert were chosen for an even share
    of the (token, expert) pairs (:func:`balanced_counts`), without reading the expert ids:
    what the dry run asks for (:func:`tpplan.analysis.fake.group.fake_process_group` opens
    it), having shapes but no ids to count. Outside it, the ids are counted."""
    _balanced[0] += 1
    try:
        yield
    finally:
        _balanced[0] -= 1


def check_experts(mesh: MeshSpec, res, modules: dict[str, nn.Module]) -> None:
    """Every ``expert_parallel`` module of a :class:`~tpplan.parallel.resolve.Resolution`
    against ``mesh.ep`` (errors at the rule), and ``mesh.ep`` against the rules: experts to
    spread, and what it does not compose with yet (errors at ``mesh.ep``); the
    ``sequence_local`` blocks beside them (:func:`check_sequence_local`). Reads ``mesh.ep``
    only (resolve runs :func:`check_aux_loss`, which reads pp and cp, just before)."""
    errs = res.errors
    check_sequence_local(res, modules, errs)
    for path, rule in res.rule_of.items():
        if rule.style.name in EP_STYLES:
            check_expert_parallel(rule, path, modules[path], mesh.ep, errs,
                                  modules.get(path.rpartition(".")[0]))
    check_rules_inside_lists(res, modules)
    ep, loc = mesh.ep, mesh.locs.get("ep", mesh.loc)
    if ep == 1:
        return
    if not any(r.style.name in EP_STYLES for r, _ in res.rules):
        errs.add(f"mesh ep={ep} but no rule uses the 'expert_parallel' style, so no experts "
                 "would be spread over it; add one for the experts modules (e.g. "
                 "'model.layers.*.mlp.experts': expert_parallel) or drop ep", loc)


def dispatch_counts(top_k_index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(token, expert) pairs per expert; ValueError naming an id out of range (a routing
    bug that a silent drop would turn into a plausible but wrong loss).

    The check rides on the one ``bincount``: an id ``>= num_experts`` lengthens it past
    ``num_experts`` and a negative one makes it fail, so in-range routing pays no extra pass
    (and no extra host sync) over the ids."""
    flat = top_k_index.reshape(-1)
    try:
        counts = torch.bincount(flat, minlength=num_experts)
    except RuntimeError:  # negative ids (bincount's own check); anything else re-raised
        if not flat.numel() or not bool((flat < 0).any()):
            raise
        counts = None
    if counts is None or counts.numel() > num_experts:
        bad = flat[(flat < 0) | (flat >= num_experts)][0].item()
        raise ValueError(f"expert_parallel: the router chose expert {bad}, outside "
                         f"[0, {num_experts}): refusing to drop its tokens")
    return counts


def routed_forward(module: nn.Module, forward, mesh: DeviceMesh, num_experts: int,
                   hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The forward :class:`ExpertParallel` gives a routed experts module (bound to the
    module, its own ``forward``, the ep mesh and the model's expert count): the dispatch, the
    module's own expert code on what arrived, the combine (the module docstring's steps).
    Looked up here when the style is applied."""
    from ..._torch.collectives import all_to_all_single_autograd

    if hidden_states.dim() != 2 or top_k_index.shape[:1] != hidden_states.shape[:1]:
        raise ValueError(f"expert_parallel: experts called with shapes {tuple(hidden_states.shape)}, "
                         f"{tuple(top_k_index.shape)}: not hidden states [T, H], expert ids [T, k]")
    if top_k_weights.shape != top_k_index.shape:
        raise ValueError(f"expert_parallel: routing weights of shape {tuple(top_k_weights.shape)}"
                         f" do not match the expert ids' {tuple(top_k_index.shape)}")
    ep, group = mesh.size(), mesh.get_group()
    local = num_experts // ep
    k = top_k_index.shape[-1]
    shapes_only = _balanced[0] > 0
    if shapes_only:  # the dry run: no ids to count, so routing is balanced
        counts = top_k_index.new_tensor(balanced_counts(top_k_index.numel(), num_experts))
    else:
        counts = dispatch_counts(top_k_index, num_experts)
    order = torch.argsort(top_k_index.reshape(-1), stable=True)  # pairs grouped by expert
    token = order // k
    got = torch.empty_like(counts)  # got[r * local + j]: rows rank r sends to my expert j
    dist.all_to_all_single(got, counts, group=group)
    if shapes_only:  # every rank routes as this one does
        got = counts.view(ep, local)[mesh.get_local_rank()].repeat(ep)
        per_expert = balanced_counts(top_k_index.numel(), num_experts)
        mine = per_expert[mesh.get_local_rank() * local:][:local]
        send = [sum(per_expert[r * local:(r + 1) * local]) for r in range(ep)]
        recv = [sum(mine)] * ep
        ids = torch.tensor([j for _ in range(ep) for j in range(local) for _ in range(mine[j])],
                           dtype=torch.long, device=got.device)
    else:
        send = counts.view(ep, local).sum(1).tolist()
        recv = got.view(ep, local).sum(1).tolist()
        ids = torch.repeat_interleave(torch.arange(local, device=got.device).repeat(ep), got)
    rows = all_to_all_single_autograd(hidden_states[token], recv, send, group)
    with using_local_experts(module, module._tpplan_ep_params, ep, module._tpplan_ep_tp):
        try:  # the module's own expert code, on its local experts
            module.num_experts = local
            out = forward(rows, ids[:, None], torch.ones(len(ids), 1, dtype=rows.dtype,
                                                          device=rows.device), *args, **kwargs)
            out = tie_experts(module, out)
            if rows.requires_grad:  # an expert code whose output need not depend on the rows
                # (transformers' eager loop returns zeros_like when no expert is hit) would skip
                # this rank's backward all-to-all that its ep peers run: a hang. Tie it (a zero).
                out = out + rows[:0].sum().to(out.dtype)
        finally:
            module.num_experts = num_experts
    back = all_to_all_single_autograd(out, send, recv, group)
    weights = top_k_weights.reshape(-1)[order].to(back.dtype)
    combined = torch.zeros_like(hidden_states)
    return combined.index_add(0, token, (back * weights[:, None]).to(combined.dtype))


def _by_position(module: nn.Module, forward, mesh: DeviceMesh, num_experts: int, *args, **kwargs):
    """:func:`routed_forward` with the three tensors given by keyword moved to positions
    (the contract is positional: a forward may name them as it likes)."""
    args, kwargs = positional_call(forward, args, kwargs)
    return routed_forward(module, forward, mesh, num_experts, *args, **kwargs)


class ExpertParallel(ParallelStyle):
    """Spread a mixture-of-experts module's routed experts over the ep ranks and route its
    tokens to them with all-to-all (see the module docstring).

    The module holds its experts as parameters ``[num_experts, ...]`` and is called as
    ``experts(hidden_states, top_k_index, top_k_weights)``; every own parameter becomes a
    DTensor ``Shard(0)`` on ``device_mesh`` (the ep mesh,
    :func:`tpplan.parallel.mesh.expert_meshes`).

    Keyword Args:
        tokens_tp (int): how many tp ranks of the ep group hold different tokens of one
            batch (tp when the MoE block runs on the sequence shard and ep borrows tp's
            ranks, else 1): the local experts' gradient is scaled by ``tokens_tp / ep``
            (:func:`tpplan.parallel.experts.forms.local_experts`). Default 1.

    Example::

        >>> ep_mesh, _ = expert_meshes(mesh, ep=2)
        >>> parallelize_module(block.mlp.experts, ep_mesh, ExpertParallel())
    """

    def __init__(self, *, tokens_tp: int = 1) -> None:
        super().__init__()
        self.tokens_tp = tokens_tp

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if isinstance(module, nn.ModuleList):  # per-expert modules: tpplan.parallel.experts.module_list
            return split_expert_list(module, device_mesh, self.src_data_rank, routed_forward,
                                     self.tokens_tp)
        num_experts = expert_count(module)
        names = local_expert_params(module)
        for name in names:
            param = own_parameters(module)[name]
            dt = distribute_tensor(param.detach(), device_mesh, [Shard(0)],
                                   src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))
        module._tpplan_ep_params = tuple(names)
        module._tpplan_ep_size = device_mesh.size()
        module._tpplan_ep_tp = self.tokens_tp
        dense = call_form(module) == "dense"
        module.forward = functools.partial(dense_forward if dense else _by_position, module,
                                           module.forward, device_mesh, num_experts)
        return module

    def __repr__(self) -> str:
        return f"ExpertParallel(tokens_tp={self.tokens_tp})"


def check_aux_loss(mesh: MeshSpec, model: nn.Module | None, errs: ErrorList) -> None:
    """A model that computes an auxiliary (load-balancing) loss -- its config sets
    ``output_router_logits`` -- on a mesh where tpplan would get it wrong: under pipeline
    stages the routers run on every stage but the loss is taken on the last; under context
    parallelism each rank's routers see part of each sequence, and the loss is not additive
    over parts. Errors at ``mesh.pp`` / ``mesh.cp``."""
    if not computes_aux_loss(model):
        return
    for key, name, why in (("pp", "pipeline stages", "the loss is taken on the last stage, "
                            "the routers run on every stage"),
                           ("cp", "context parallelism", "each rank's routers see part of "
                            "each sequence")):
        degree = getattr(mesh, key)
        if degree > 1:
            errs.add(f"mesh {key}={degree}: the model computes its load-balancing loss "
                     f"(output_router_logits: true), which tpplan does not add under {name} "
                     f"yet ({why}); set model.config.output_router_logits: false, or drop "
                     f"{key}", mesh.locs.get(key, mesh.loc))
