"""What a sharding style splits of a module, and the check that tp divides it."""

from __future__ import annotations

import torch.nn as nn

from ...plan.errors import ErrorList
from ...plan.specs import Rule

__all__ = ["SHARD_DIMS", "shard_dims", "check_sharding"]

# (style, module type) -> {parameter: the dimension the style splits}
SHARD_DIMS: dict[tuple[str, type], dict[str, int]] = {
    ("colwise", nn.Linear): {"weight": 0, "bias": 0},
    ("rowwise", nn.Linear): {"weight": 1},
    ("colwise", nn.Embedding): {"weight": 1},
    ("rowwise", nn.Embedding): {"weight": 0},
    ("packed_colwise", nn.Linear): {"weight": 0, "bias": 0},  # parallel.packed
    ("experts_colwise_rowwise", nn.Module): {"gate_up_proj": 1, "down_proj": 2},
}
TORCH_CLASS = {"colwise": "ColwiseParallel", "rowwise": "RowwiseParallel"}


def shard_dims(style: str, module: nn.Module) -> dict[str, int] | None:
    """Which dimension of which parameter ``style`` splits over tp on ``module``; None if
    the style does not shard this kind of module."""
    return next((dims for (s, kind), dims in SHARD_DIMS.items()
                 if s == style and isinstance(module, kind)), None)


def check_sharding(rule: Rule, path: str, module: nn.Module, tp: int, errs: ErrorList) -> None:
    """``rule``'s style can shard ``module`` and tp divides what it splits (or the rule
    says ``uneven``); errors at the rule."""
    style = rule.style.name
    dims = shard_dims(style, module)
    if dims is None:
        errs.add(f"style '{style}' cannot shard module '{path}' ({type(module).__name__}): "
                 f"PyTorch's {TORCH_CLASS[style]} shards nn.Linear and nn.Embedding only", rule.loc)
        return
    for pname, dim in dims.items():
        param = getattr(module, pname, None)
        if param is None:
            continue
        size = param.shape[dim]
        if rule.style.options.get("uneven") and size >= tp:
            continue  # ceil(size/tp) rows on the first ranks, fewer on the last
        if size % tp:
            errs.add(f"module '{path}' ({type(module).__name__}), parameter '{pname}': dimension {dim} "
                     f"of size {size} is not divisible by tp={tp} (rule '{rule.pattern}' is "
                     f"{style}){_uneven_hint(size, tp)}", rule.loc)


def _uneven_hint(size: int, tp: int) -> str:
    if size < tp:
        return f": fewer rows than ranks; use a tp of at most {size}"
    big = -(-size // tp)
    rows = [min(big, max(0, size - i * big)) for i in range(tp)]  # torch.chunk's split
    shown = ", ".join(map(str, rows)) if tp <= 8 else f"{rows[0]} ... {rows[-1]}"
    return (f"; add 'uneven: true' to the rule to split it unevenly ({shown} per rank; the "
            f"parameter keeps its {size} rows in checkpoints and exports)")
