"""transformers' mixture-of-experts forward as the dry run runs it, on shapes alone.

A real run of a transformers 5 MoE uses its default experts implementation, ``grouped_mm``:
the (token, expert) pairs sorted by expert, one grouped GEMM up, the gate, one grouped GEMM
down (``transformers/integrations/moe.py``, ``grouped_mm_experts_forward``). On fake or meta
tensors two things stand in the way: torch's ``grouped_mm`` meta kernel takes bfloat16 only,
and the eager loop over experts asks ``nonzero()`` for values. ``batched_mm``, which runs on
shapes, gathers a copy of each pair's expert weights (``[T·k, 2I, H]``): for Qwen3-30B-A3B at
4,096 tokens, 384 GiB per block saved for backward where the real run saves ``T·k`` rows
(27 TiB over its 48 blocks, where the real run's activations are 81 GiB in fp32).

:data:`SHAPES_ONLY` is the same ``grouped_mm`` forward with its grouped GEMMs through
transformers' own fallback operator (``transformers::grouped_mm_fallback``), whose fake
kernel takes every dtype and which saves for backward what ``grouped_mm`` saves (its input
and the stacked weights, a parameter): so the dry run holds, per block, the rows the real run
holds. Under expert parallelism those are the rows that arrived, ``T·k`` per rank under
balanced routing (:mod:`tpplan.parallel.experts.style`).
"""

from __future__ import annotations

import torch

from .._torch.transformers import grouped_mm_ruled_out

__all__ = ["SHAPES_ONLY", "register_shapes_only"]

SHAPES_ONLY = "tpplan_grouped_mm_shapes"  # the name it is registered under


def _grouped_mm_on_shapes(module: torch.nn.Module, hidden_states: torch.Tensor,
                          top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *args,
                          **kwargs) -> torch.Tensor:
    """``grouped_mm_experts_forward`` with torch's grouped GEMM kernel ruled out for the
    call (its fallback operator takes over: the same shapes and saved tensors)."""
    from transformers.integrations import moe

    with grouped_mm_ruled_out():
        return moe.grouped_mm_experts_forward(module, hidden_states, top_k_index, top_k_weights,
                                              *args, **kwargs)


def register_shapes_only() -> str | None:
    """Register :data:`SHAPES_ONLY` with transformers' experts interface; its name, or None
    when this transformers has no grouped_mm forward to follow."""
    try:
        from transformers.integrations import moe
    except ImportError:
        return None
    if not all(hasattr(moe, n) for n in ("grouped_mm_experts_forward", "_can_use_grouped_mm",
                                         "ExpertsInterface")) or \
            not hasattr(torch.ops.transformers, "grouped_mm_fallback"):
        return None
    moe.ExpertsInterface.register(SHAPES_ONLY, _grouped_mm_on_shapes)
    return SHAPES_ONLY
