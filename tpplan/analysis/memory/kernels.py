"""Every operator of the trainer's step that is not a GEMM, counted from the same traced step
that gives the memory figures: how many kernels, and the bytes each reads and writes.

The step runs on fake tensors under the memory tracker (:mod:`.step`); with a
:class:`KernelCount` attached, each operator PyTorch dispatches on a rank's local tensors is
sorted into one of: a GEMM or attention (priced by their FLOPs in the compute term), a
collective (the communication terms), a view or an allocation (no kernel, no bytes), or a
memory-bound kernel — elementwise, norms, softmax, cross-entropy, casts, FSDP2's copies,
AdamW's update — whose bytes are its tensor inputs plus outputs (an expanded input by its
storage). :func:`kernel_profile` extrapolates a model's repeated blocks from two shallow
traces, as the memory trace does, and weights the micro-batches as the step runs them.
"""

from __future__ import annotations

from typing import Any

import torch

from ..._torch.dispatch import tree_flatten
from .step import count_kernels

__all__ = ["KernelCount", "kernel_kind", "kernel_profile"]

GEMMS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "_scaled_mm", "_int_mm", "addmv", "mv"}
ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
               "detach", "alias", "lift_fresh", "set_", "resize_", "_local_scalar_dense"}
COLLECTIVES = {"c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd",
               "_dtensor", "prim", "profiler"}


def kernel_kind(func) -> str:
    """``gemm``, ``attention``, ``collective``, ``none`` (a view or an allocation) or
    ``memory`` (a memory-bound kernel) for an operator overload."""
    ns = getattr(func, "namespace", "")
    name = func.__name__.split(".")[0] if hasattr(func, "__name__") else str(func)
    if ns in COLLECTIVES:
        return "collective"
    if name in GEMMS:
        return "gemm"
    if "attention" in name:  # SDPA's flash / efficient / cudnn / math kernels and their backward
        return "attention"
    if getattr(func, "is_view", False) or name in ALLOCATIONS or name.startswith("sym_"):
        return "none"
    return "memory"


def _bytes(t: torch.Tensor) -> int:
    dense = t.numel() * t.element_size()
    try:
        return min(dense, t.untyped_storage().nbytes())  # an expanded input reads its storage
    except (RuntimeError, NotImplementedError):
        return dense


class KernelCount:
    """Memory-bound kernels by micro-batch stage (``only``, ``first``, ``middle``, ``last``,
    ``optimizer``): each kernel's bytes (``sizes``), and by operator name (``ops``: (stage,
    name) -> [kernels, bytes], the list the term's arithmetic is held against)."""

    def __init__(self) -> None:
        self.sizes: dict[str, list[int]] = {}
        self.ops: dict[tuple[str, str], list[int]] = {}

    def add(self, func, args: tuple, kwargs: dict, out: Any, label: str) -> None:
        if kernel_kind(func) != "memory":
            return
        stage = label.split("/", 1)[0]
        moved = sum(_bytes(t) for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor))
        self.sizes.setdefault(stage, []).append(moved)
        row = self.ops.setdefault((stage, str(func)), [0, 0])
        row[0] += 1
        row[1] += moved

    def per_step(self, accum: int, cost=len) -> float:
        """``cost`` (of a stage's list of kernel sizes) summed over one optimizer step of
        ``accum`` micro-batches: the traced middle micro-batch stands for every one between
        the first and the last. ``len``: kernels; ``sum``: bytes."""
        weight = {"middle": max(accum - 2, 0), "setup": 0}
        return sum(cost(sizes) * weight.get(stage, 1) for stage, sizes in self.sizes.items())


def kernel_profile(spec, mesh, build, shape, n_blocks: int, blocks: str | None, io=None) -> dict[str, Any]:
    """The step's memory-bound kernels, ``{traces, depths, periods, accum}``: traced at one
    and two periods of blocks (the period of selective checkpointing, else 1) where the
    model has identical repeated blocks (``periods``: how many the whole model has, for a
    linear extrapolation), else traced whole. ``io``: ``build`` makes one pipeline stage
    (a :class:`~tpplan.analysis.memory.step.StageIO`), traced as
    :func:`~tpplan.analysis.memory.stages.stage_traces` traces its memory.
    :func:`tpplan.analysis.cost.non_gemm.non_gemm_seconds` prices it."""
    k = spec.activation_checkpointing.every
    depths = [k, 2 * k] if blocks is not None and n_blocks >= 2 * k and not n_blocks % k else [None]
    traces = []
    for depth in depths:
        traces.append(KernelCount())
        count_kernels(spec, mesh, build, shape, depth, traces[-1], io)
    return dict(traces=traces, depths=depths, periods=n_blocks // k if depths[0] else 1,
                accum=shape.grad_accum)
