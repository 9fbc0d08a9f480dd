"""Per-operator selective activation checkpointing (``activation_checkpointing: op``).

torchtitan's "op" SAC: inside each checkpointed block, keep the outputs of the operators that
are expensive to recompute — every other matmul, attention, and the tp collectives that
reduce — and recompute everything else (norms, activations, rotary, elementwise) in backward.
The saved outputs cost memory between full checkpointing (the block's input only) and none
(everything); the recomputation costs about half of a block's matmuls and none of its
attention or communication. Built on the public
``torch.utils.checkpoint.create_selective_checkpoint_contexts``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = ["SAVED_OPS", "op_checkpointed_forward"]


def _ops(*names: str) -> set[Any]:
    """The aten / c10d overloads among ``names`` this torch build has (``ns.op.overload``)."""
    found = set()
    for name in names:
        ns, op, overload = name.split(".")
        packet = getattr(getattr(torch.ops, ns), op, None)
        if packet is not None and hasattr(packet, overload):
            found.add(getattr(packet, overload))
    return found


# torchtitan's list: matmuls (every other one is saved, below), each attention kernel, and the
# reductions whose recomputation would repeat a collective or a max over a large tensor.
SAVED_OPS = _ops(
    "aten.mm.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_mm.default",
    "aten.max.default",
    "_c10d_functional.reduce_scatter_tensor.default",
    "_c10d_functional.all_reduce.default",
)
_MM = _ops("aten.mm.default")


def _policy() -> Callable:
    counts: dict[str, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        # forward and recompute count separately, so both pick the same matmuls
        key = "recompute" if ctx.is_recompute else "forward"
        if func in _MM:
            counts[key] += 1
        # every second matmul is recomputed: half of the matmul memory for a quarter of the work
        save = func in SAVED_OPS and not (func in _MM and counts[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _contexts():
    return create_selective_checkpoint_contexts(_policy())


def op_checkpointed_forward(forward: Callable, *args, **kwargs) -> Any:
    """``forward(*args, **kwargs)`` under per-operator selective checkpointing (a fresh matmul
    count each call, so each block saves its own first, third, ... matmul)."""
    return checkpoint(forward, *args, use_reentrant=False, context_fn=_contexts, **kwargs)

