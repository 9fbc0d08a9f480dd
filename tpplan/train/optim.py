"""The optimizer side of a step: AdamW over the trained parameters, its learning-rate
schedule, and gradient clipping that is right for DTensor gradients on any mesh."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["adamw_implementation", "clip_grad_norm", "lr_lambda", "make_optimizer", "trained_summary"]


def adamw_implementation(device_type: str) -> dict[str, bool]:
    """AdamW's kernel for ``device_type``: ``fused=True`` on CUDA (one kernel for every
    parameter of a group, no temporaries the size of the group: the step the dry run's trace
    prices); elsewhere PyTorch's default, which is ``foreach`` where the device has foreach
    kernels and the per-parameter loop where it has none (CPU: foreach would only add a
    group-sized temporary there, and CPU's fused kernel is left to its users)."""
    return {"fused": True} if device_type == "cuda" else {}


def make_optimizer(model: nn.Module, t) -> tuple[torch.optim.Optimizer, list[nn.Parameter]]:
    """AdamW over the parameters that train (``freeze`` sets the others' ``requires_grad``
    off: no gradient, no optimizer state) and the list of them; fused on CUDA
    (:func:`adamw_implementation`)."""
    trained = [p for p in model.parameters() if p.requires_grad]
    device_type = trained[0].device.type if trained else "cpu"
    return torch.optim.AdamW(trained, lr=t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay,
                             **adamw_implementation(device_type)), trained


def trained_summary(trained: list, n_params: int) -> str:
    """``, 0.50M trained (the rest frozen)`` for the header; empty when everything trains."""
    n = sum(p.numel() for p in trained)
    return "" if n == n_params else f", {n / 1e6:.2f}M trained (the rest frozen)"


def lr_lambda(step: int, warmup: int, total: int, lr: float, min_lr: float) -> float:
    """Multiplier of ``lr`` at optimizer step ``step`` (0-based): linear warmup, then cosine
    from ``lr`` down to ``min_lr`` at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    span = max(total - warmup, 1)
    progress = min((step - warmup) / span, 1.0)
    floor = min_lr / lr
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def clip_grad_norm(params: Iterable[nn.Parameter], max_norm: float | None,
                   pp_group=None, ep_local: dict[int, object] | None = None) -> float:
    """Global L2 norm of all gradients (clipped to ``max_norm`` if given), correct for
    DTensor gradients on any mix of meshes and placements, and over every pipeline stage
    when ``pp_group`` is given (each pp rank holds other parameters: their squares add).

    Norms are computed per (mesh, placements) group -- a group's norm of sharded DTensors is
    a Partial DTensor and ``full_tensor()`` reduces it over exactly the ranks that hold
    shards -- then combined as the root of the sum of squares. One ``get_total_norm`` over
    mixed groups would fail or double-count.

    ``ep_local``: ``id(parameter)`` -> the ep process group, for parameters that only their
    ep rank holds (a list of experts split over ep:
    :func:`tpplan.parallel.experts.module_list.expert_list_groups`); their squares add over it.
    """
    params = [p for p in params if p.grad is not None]
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        g = p.grad
        key = (g.device_mesh, g.placements) if isinstance(g, DTensor) else g.device
        groups[key, (ep_local or {}).get(id(p))].append(g)
    squares = []
    for (_, ep_group), grads in groups.items():
        n = torch.nn.utils.get_total_norm(grads, 2.0)
        if isinstance(n, DTensor):
            n = n.full_tensor()
        squares.append(n.float() ** 2)
        if ep_group is not None:
            import torch.distributed as dist

            dist.all_reduce(squares[-1], group=ep_group)
    total = torch.stack([s.cpu() for s in squares]).sum() if squares else torch.zeros(())
    if pp_group is not None:
        import torch.distributed as dist

        device = squares[0].device if squares else "cpu"  # nccl reduces on the GPU
        total = total.to(device)
        dist.all_reduce(total, group=pp_group)
    total = total.cpu().sqrt()
    if max_norm is not None:
        coef = min(max_norm / (float(total) + 1e-6), 1.0)
        if coef < 1.0:
            for p in params:
                p.grad.mul_(coef)
    return float(total)
