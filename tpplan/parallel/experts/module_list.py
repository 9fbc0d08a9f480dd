"""Expert parallelism for a list of per-expert modules (docs/moe.md, "A list of experts").

A user's MoE (Megatron's ``SequentialMLP``, a torchtitan-style model written with one module
per expert, transformers 4's Mixtral) may hold its experts as an ``nn.ModuleList`` of
identical modules (``experts.5.w1.weight``). ``expert_parallel`` spreads such a list when it
keeps the contract of the grouped form:

- the parent calls the list **once** per forward, on every rank, as
  ``experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``
  (the router runs in the parent on the rank's own tokens), so the list has a ``forward`` of
  its own (``tpplan.models.expert_list.ExpertList`` is one);
- that forward finds its experts through the list itself (``len(self)``, ``self[i]``,
  iterating it) or ``self.num_experts``, and an id ``i`` in ``top_k_index`` means ``self[i]``.

A plain ``nn.ModuleList`` has no forward: its parent calls each expert itself
(``for i in range(E): self.experts[i](x_i)``), so under ep a rank would call experts it does
not hold, and making each call a collective would cost ``E`` round trips per block where the
routed call costs one dispatch. It is refused, located at the rule.

Under the style each ep rank keeps its ``E / ep`` consecutive experts and drops the others:
the list keeps them under their **global** indices (``_modules["4"]``, ``["5"]`` on ep rank 2
of 4 with 8 experts), so parameter names, and with them DCP checkpoints, are the whole
model's (``experts.5.w1.weight``) and a run resumes on any ep or on a plain model. FSDP2
then shards each local expert's parameters over ``efsdp``. The call goes through the grouped
form's dispatch (:func:`tpplan.parallel.experts.style.routed_forward`, passed in): the list's
own forward runs on the rows that arrived, seeing its local experts as ``self[0..E/ep-1]``.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from ..._torch.modules import own_children, own_parameters, set_children, set_parameters, swapped
from ...plan.errors import ErrorList
from ...plan.patterns import enclosing
from ...plan.specs import Rule
from ...plan.styles import EP_STYLES
from .forms import param_owner, call_form, list_expert_count

__all__ = ["check_expert_list", "check_rules_inside_lists", "split_expert_list",
           "gather_expert_lists", "is_split_list", "expert_list_groups", "local_experts_call"]


def is_split_list(module: nn.Module) -> bool:
    """Whether ``module`` is a list of experts :func:`split_expert_list` spread over ep."""
    return isinstance(module, nn.ModuleList) and bool(getattr(module, "_tpplan_ep_size", None))


def _where_called(parent: nn.Module | None, attr: str) -> str:
    """Where the parent's forward indexes or iterates the list (``file:line``), if it does."""
    try:
        lines, first = inspect.getsourcelines(type(parent).forward)
        path = inspect.getsourcefile(type(parent).forward)
    except (TypeError, OSError, AttributeError):  # no parent, or its source is not at hand
        return ""
    for i, line in enumerate(lines):
        if f"self.{attr}[" in line or f"in self.{attr}" in line:
            return f" (at {path}:{first + i}: {line.strip()})"
    return ""


def check_expert_list(rule: Rule, path: str, module: nn.ModuleList, ep: int, errs: ErrorList,
                      parent: nn.Module | None = None) -> None:
    """Whether ``expert_parallel`` can spread the list ``module`` at ``ep``; errors at the rule."""
    where = f"module '{path}' ({type(module).__name__})"
    experts = list(module)
    if type(module).forward is nn.ModuleList.forward:
        owner = f"its parent ({type(parent).__name__})" if parent is not None else "its parent"
        errs.add(f"{where} is a list of expert modules without a forward of its own: "
                 f"{owner} calls each expert itself{_where_called(parent, path.rpartition('.')[2])}, "
                 "so under ep a rank would call experts it does not hold. expert_parallel needs "
                 "the list called once as experts(hidden_states [T, H], top_k_index [T, k], "
                 "top_k_weights [T, k]): make it a tpplan.models.expert_list.ExpertList (same "
                 "parameter names) and call it so (docs/moe.md, 'A list of experts')", rule.loc)
        return
    if call_form(module) != "routed":
        names = list(inspect.signature(module.forward).parameters)
        errs.add(f"{where} is not called as experts(hidden_states, top_k_index, top_k_weights) "
                 f"(its forward takes {', '.join(names) or 'nothing'}), so expert_parallel "
                 "cannot route its tokens", rule.loc)
        return
    n = list_expert_count(module)
    if n is None:
        kinds = sorted({type(m).__name__ for m in experts})
        errs.add(f"{where} is not a list of identical experts ({len(experts)} modules: "
                 f"{', '.join(kinds) or 'none'}): expert_parallel splits a list whose experts "
                 "are of one class with the same parameters (names and shapes)", rule.loc)
        return
    if n % ep:
        errs.add(f"{where} holds {n} experts and mesh ep={ep} does not divide them", rule.loc)


def check_rules_inside_lists(res, modules: dict[str, nn.Module]) -> None:
    """A rule on a module inside a list of experts that ``expert_parallel`` spreads (expert
    TP inside EP): errors at that rule. The style keeps each expert whole on every tp rank."""
    lists = [p for p, r in res.rule_of.items()
             if r.style.name in EP_STYLES and isinstance(modules[p], nn.ModuleList)]
    for path, rule in res.rule_of.items():
        owner = enclosing(path, lists)
        if owner is not None:
            res.errors.add(f"module '{path}' is inside '{owner}', a list of experts that "
                           f"{res.rule_of[owner].style.name} spreads over ep: expert TP inside "
                           "EP (the experts split over tp too) is not supported; the experts "
                           "stay whole on every tp rank, so drop this rule", rule.loc)


def local_experts_call(module: nn.ModuleList, forward, *args, **kwargs):
    """The list's own forward, seeing its local experts as ``self[0 .. E/ep - 1]``."""
    local = {str(j): m for j, m in enumerate(own_children(module).values())}
    with swapped(module, children=local, all_children=True):
        return forward(*args, **kwargs)


def split_expert_list(module: nn.ModuleList, mesh: DeviceMesh, src_data_rank: int | None,
                      ep_forward, tokens_tp: int = 1) -> nn.ModuleList:
    """Keep this ep rank's ``E / ep`` experts of ``module`` (under their global indices), their
    parameters taken from the ep group's ``src_data_rank`` (as ``distribute_tensor`` does for
    every style), and route the list's calls through ``ep_forward`` (the grouped form's
    dispatch). ``tokens_tp``: as the grouped form's (``module._tpplan_ep_tp``)."""
    experts = list(module)
    num, ep, rank = len(experts), mesh.size(), mesh.get_local_rank()
    local = num // ep
    names = [n for n, _ in experts[0].named_parameters()]
    mine = range(rank * local, (rank + 1) * local)
    for name in names:  # one scatter per parameter name: expert e's rows of the stack [E, ...]
        stacked = torch.stack([e.get_parameter(name).detach() for e in experts])
        part = distribute_tensor(stacked, mesh, [Shard(0)], src_data_rank=src_data_rank).to_local()
        for j, e in enumerate(mine):
            owner, leaf = param_owner(experts[e], name)
            old = own_parameters(owner)[leaf]
            set_parameters(owner, {leaf: nn.Parameter(part[j].clone(), requires_grad=old.requires_grad)})
    set_children(module, {str(e): experts[e] for e in mine})  # the others are gone: no full copy
    module.num_experts = num
    module._tpplan_ep_size = ep
    module._tpplan_ep_tp = tokens_tp
    module._tpplan_ep_mesh = mesh
    module._tpplan_ep_params = tuple(f"{e}.{n}" for e in mine for n in names)
    module.forward = functools.partial(ep_forward, module,
                                       functools.partial(local_experts_call, module, module.forward),
                                       mesh, num)
    return module


def gather_expert_lists(models: list[nn.Module], values: dict[str, torch.Tensor]
                        ) -> dict[str, torch.Tensor]:
    """``values`` (full tensors by parameter name, each rank its own experts') completed with
    every expert of each split list, gathered over its ep group: what ``verify`` compares
    with one device. Collective on every rank of the lists' ep groups."""
    for model in models:
        for path, m in model.named_modules():
            if not is_split_list(m):
                continue
            mine = {k: v for k, v in values.items() if k.startswith(path + ".")}
            everyone: list = [None] * m._tpplan_ep_size
            dist.all_gather_object(everyone, mine, group=m._tpplan_ep_mesh.get_group())
            for part in everyone:
                values.update(part)
    return values


def expert_list_groups(models: list[nn.Module]) -> dict[int, object]:
    """``id(parameter)`` -> its ep process group, for every parameter of a split list of
    experts: only its ep rank holds it, so a norm over all parameters adds its square over
    the ep group (:func:`tpplan.train.optim.clip_grad_norm`). Take it after FSDP2 and
    materializing, which make the parameters the optimizer holds."""
    return {id(p): m._tpplan_ep_mesh.get_group() for model in models
            for m in model.modules() if is_split_list(m) for p in m.parameters()}
