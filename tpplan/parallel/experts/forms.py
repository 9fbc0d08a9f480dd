"""The forms of an experts module ``expert_parallel`` spreads (docs/moe.md): how many
experts it holds, how it is called, and the dense dispatch of Llama 4's experts, which take
every token for every expert."""

from __future__ import annotations

import contextlib
import inspect
from typing import Iterator

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..._torch.modules import own_parameters, swapped

__all__ = ["expert_count", "list_expert_count", "call_form", "positional_call", "computes_aux_loss", "experts_for_ep",
           "local_experts", "using_local_experts", "param_owner", "tie_experts", "dense_forward"]

# What the forward is given, by position: three tensors (hidden states [T, H], expert ids
# [T, k], routing weights [T, k]) under any names -- transformers' (hidden_states,
# top_k_index, top_k_weights), gpt-oss's (hidden_states, router_indices, routing_weights),
# a user's (x, idx, w). gpt-oss stores its expert weights transposed ([E, in, out]) with
# biases; the style only splits dimension 0 and calls the module's own forward, so neither
# matters to it.
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def expert_count(module: nn.Module) -> int | None:
    """The number of routed experts a module holds as ``[num_experts, ...]`` parameters
    (its ``num_experts`` attribute, every own parameter leading with it, one at least a
    stack of matrices: a router's ``[num_experts, hidden]`` weight is not), else None; for a
    list of per-expert modules, :func:`list_expert_count`."""
    if isinstance(module, nn.ModuleList):
        return list_expert_count(module)
    n = getattr(module, "num_experts", None)
    params = list(module.parameters(recurse=False))
    if not isinstance(n, int) or isinstance(n, bool) or n < 1 or not params:
        return None
    stacked = all(p.dim() >= 2 and p.shape[0] == n for p in params)
    return n if stacked and any(p.dim() == 3 for p in params) else None


def list_expert_count(module: nn.Module) -> int | None:
    """The number of experts of an ``nn.ModuleList`` of per-expert modules that
    ``expert_parallel`` can spread (tpplan.parallel.experts.module_list): called in the routed form,
    its experts of one class with the same parameters (names and shapes), one at least a
    matrix; else None. A list split over ep keeps its whole count in ``num_experts``."""
    if getattr(module, "_tpplan_ep_size", None):
        return module.num_experts
    experts = list(module) if isinstance(module, nn.ModuleList) else []
    if not experts or call_form(module) != "routed":
        return None
    shapes = [[(n, tuple(p.shape)) for n, p in m.named_parameters()] for m in experts]
    same = all(type(m) is type(experts[0]) and s == shapes[0] for m, s in zip(experts, shapes))
    return len(experts) if same and any(len(s) >= 2 for _, s in shapes[0]) else None


def computes_aux_loss(model: nn.Module | None) -> bool:
    """Whether ``model`` computes a load-balancing loss that tpplan adds to the loss (its
    config sets ``output_router_logits`` and a non-zero ``router_aux_loss_coef``)."""
    config = getattr(model, "config", None)
    return bool(getattr(config, "output_router_logits", False) and
                getattr(model, "router_aux_loss_coef", 0))


def call_form(module: nn.Module) -> str | None:
    """How the experts module is called, told by the arity of its forward alone (names do not
    matter): ``"routed"`` (three tensors by position: hidden states, expert ids, weights;
    further arguments only with defaults), ``"dense"`` (one: Llama 4's every token for every
    expert, pre-weighted) or None."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = [p for p in params if p.kind in _POSITIONAL]
    required = [p for p in params if p.default is p.empty and p.kind not in
                (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    if len(required) > len(positional[:3]) or any(p not in positional for p in required):
        return None
    if len(positional) == 1:
        return "dense"
    return "routed" if len(positional) >= 3 and len(required) <= 3 else None


def positional_call(forward, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``forward``'s arguments with its first three (the routed form's tensors) moved to
    positions, whatever they are named, so a caller may pass them by keyword."""
    try:
        bound = inspect.signature(forward).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return args, kwargs
    names = [n for n, p in inspect.signature(forward).parameters.items() if p.kind in _POSITIONAL][:3]
    if len(args) >= 3 or not all(n in bound.arguments for n in names):
        return args, kwargs
    rest = {k: v for k, v in kwargs.items() if k not in names}
    return tuple(bound.arguments[n] for n in names), rest


def experts_for_ep(model: nn.Module) -> list[str]:
    """The paths of ``model``'s experts modules that ``expert_parallel`` can spread."""
    return [p for p, m in model.named_modules()
            if expert_count(m) is not None and call_form(m) is not None]


class _LocalExperts(torch.autograd.Function):
    """The local experts as views (identity forward); in backward each gradient times
    ``scale``, in one node for all of them, and a zero gradient for a view the forward did
    not use (autograd materialises its missing gradient as zeros), so every local expert has
    a gradient as soon as one of them is in the graph."""

    @staticmethod
    def forward(ctx, scale: float, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.scale = scale
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        if ctx.scale == 1:
            return (None, *grads)
        return (None, *(g * ctx.scale for g in grads))


def local_experts(module: nn.Module, names, ep: int, tp: int = 1) -> dict[str, torch.Tensor]:
    """The local experts, by parameter name, to swap in for the module's parameters
    (:func:`using_local_experts`).

    Their gradient is scaled by ``1/ep``: the all-to-all brought the tokens of all ep ranks
    here, so it is the sum of ep ranks' losses' gradients, where every other parameter's is
    one rank's; FSDP2 then averages over the efsdp (and dp_replicate) ranks as for the rest.
    ``tp``: the tp ranks among the ep ranks when ep borrows them (the MoE block on the
    sequence shard): those hold parts of one loss's tokens, whose gradients add up to that
    loss's (as tp's partial gradients do), so the scale is ``tp / ep`` (= ``efsdp`` over
    the ``dp_shard × cp`` ranks every other gradient is averaged over).
    (FSDP2's own ``set_gradient_divide_factor`` would do it, but needs PREMUL_SUM, which
    gloo lacks.) One :class:`_LocalExperts` node does it for all of them and gives every
    local expert a gradient, zero where no token used it, so each rank's gradients (and
    FSDP's reduce-scatter of them) cover the same parameters; :func:`tie_experts` covers the
    case where no token reached any."""
    held = {n: own_parameters(owner)[leaf] for n in names for owner, leaf in [param_owner(module, n)]}
    local = {n: p.to_local() if isinstance(p, DTensor) else p for n, p in held.items()}
    trained = [n for n, p in held.items() if p.requires_grad]  # frozen ones stay out of it
    if trained:
        local.update(zip(trained, _LocalExperts.apply(tp / ep, *(local[n] for n in trained))))
    return local


@contextlib.contextmanager
def using_local_experts(module: nn.Module, names, ep: int, tp: int = 1) -> Iterator[nn.Module]:
    """``module`` with :func:`local_experts` in place of its parameters ``names`` for the
    ``with`` block, put back on leaving, also when the block raises."""
    with swapped(module, parameters=local_experts(module, names, ep, tp)):
        yield module


def param_owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module that registers parameter ``name`` (dotted under a list of experts: the
    expert's own submodule) and its name there."""
    path, _, leaf = name.rpartition(".")
    return (module.get_submodule(path) if path else module), leaf


def tie_experts(module: nn.Module, out: torch.Tensor) -> torch.Tensor:
    """``out``, tied to the local experts (zero weight) when it has no rows: the experts'
    forward then used none of them, and the gradient would miss them all."""
    if out.shape[0]:
        return out
    for n in module._tpplan_ep_params:
        owner, leaf = param_owner(module, n)
        param = own_parameters(owner)[leaf]
        if param.requires_grad:
            return out + param.sum() * 0
    return out


def dense_forward(module: nn.Module, forward, mesh: DeviceMesh, num_experts: int,
                      hidden_states: torch.Tensor) -> torch.Tensor:
    """Llama 4's experts take every token for every expert, already weighted by the router
    (zero where not chosen): ``[num_experts × T, H]`` in expert-major blocks. Each rank's
    blocks for the experts of rank ``s`` go to ``s`` (equal splits), the local experts run
    on ``ep × T`` rows each, and the results come back the same way."""
    from ..._torch.collectives import all_to_all_single_autograd

    ep, group = mesh.size(), mesh.get_group()
    local, width = num_experts // ep, hidden_states.shape[-1]
    if hidden_states.shape[0] % num_experts:
        raise ValueError(f"expert_parallel: {hidden_states.shape[0]} rows are not "
                         f"{num_experts} experts' blocks of tokens")
    rows = hidden_states.shape[0] // num_experts
    split = [local * rows] * ep
    got = all_to_all_single_autograd(hidden_states.contiguous(), split, split, group)
    x = got.view(ep, local, rows, width).transpose(0, 1).reshape(-1, width)
    with using_local_experts(module, module._tpplan_ep_params, ep, module._tpplan_ep_tp):
        try:
            module.num_experts = local
            out = tie_experts(module, forward(x))
        finally:
            module.num_experts = num_experts
    out = out.view(local, ep, rows, width).transpose(0, 1).reshape(-1, width)
    return all_to_all_single_autograd(out.contiguous(), split, split, group)
