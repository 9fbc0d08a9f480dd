"""Packed parameters: the row order tpplan holds them in, as plain integer arithmetic.

A packed weight stacks several parts along one dimension (Phi-3's ``qkv_proj`` rows are
``[q; k; v]``, an MLP's ``gate_up_proj`` ``[gate; up]``). Sharded part by part over tp,
rank ``t`` holds ``[q_t; k_t; v_t]``: slice ``t`` of every part. tpplan keeps such a
parameter as a DTensor sharded on that dimension (``Shard(dim)``) of the *tp-interleaved*
tensor ``[q_0; k_0; v_0; q_1; k_1; v_1; ...]``, so that every rank's shard is one
contiguous block, as FSDP2, the optimizer and the memory accounting expect. The
interleaved order depends on tp; the model's own order (HuggingFace's, a checkpoint's)
does not. :func:`packed_order` maps one to the other, and every place that sees whole
tensors (checkpoints, HF weights, initialization, verify's gradients) converts with it.

The modules that hold packed parameters say so in an attribute (:data:`ATTR`):
``{parameter name: Packing}``; :func:`packed_params` collects them by parameter path.
No torch here: the layers above turn the order into index tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ATTR", "Packing", "packed_order", "packed_params", "part_sizes", "runs"]

ATTR = "tpplan_packed"  # on a module: {parameter name: Packing}


@dataclass(frozen=True)
class Packing:
    """Parameter dimension ``dim`` holds parts of ``sizes`` (in the model's order), each
    split in ``tp`` equal slices; the parameter is held in the tp-interleaved order."""

    dim: int
    sizes: tuple[int, ...]
    tp: int

    def order(self) -> list[int]:
        return packed_order(self.sizes, self.tp)


def part_sizes(total: int, proportions: list[int]) -> list[int] | None:
    """Sizes of parts in ``proportions`` of ``total``; None if they do not divide it."""
    whole = sum(proportions)
    if whole <= 0 or total % whole:
        return None
    return [total // whole * p for p in proportions]


def packed_order(sizes: tuple[int, ...] | list[int], tp: int) -> list[int]:
    """``order[i]`` = the model-order index of row ``i`` of the tp-interleaved tensor."""
    order: list[int] = []
    for t in range(tp):
        start = 0
        for size in sizes:
            n = size // tp
            order += range(start + t * n, start + (t + 1) * n)
            start += size
    return order


def runs(indices: list[int]) -> list[tuple[int, int, int]]:
    """Consecutive stretches of ``indices``: ``(position, first index, length)`` each."""
    out: list[tuple[int, int, int]] = []
    for pos, i in enumerate(indices):
        if out and out[-1][1] + out[-1][2] == i:
            p, first, n = out[-1]
            out[-1] = (p, first, n + 1)
        else:
            out.append((pos, i, 1))
    return out


def packed_params(model: Any) -> dict[str, Packing]:
    """``{parameter path: Packing}`` of every packed parameter of ``model`` (an nn.Module)."""
    out: dict[str, Packing] = {}
    for path, module in model.named_modules():
        for name, packing in (getattr(module, ATTR, None) or {}).items():
            out[f"{path}.{name}" if path else name] = packing
    return out
