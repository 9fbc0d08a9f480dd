"""The step's time outside GEMMs: each memory-bound kernel's bytes over the device's memory
bandwidth, and at least a launch floor per kernel.

The kernels are the traced step's own (:func:`tpplan.analysis.memory.kernels.kernel_profile`:
elementwise, norms, softmax, cross-entropy, casts, FSDP2's copies, AdamW's update over the
sharded state), each kernel ``max(bytes / (memory_bandwidth × HBM_EFFICIENCY), KERNEL_LAUNCH_S)``.
Constants, not fitted to any measured step:

- ``memory_bandwidth``: the device preset's, from the data sheet (H100 SXM 3.35 TB/s, H200
  4.8 TB/s, A100 80GB 2.04 TB/s);
- ``HBM_EFFICIENCY`` 0.85: the fraction of the data-sheet bandwidth a large streaming kernel
  reaches on HBM GPUs (BabelStream's copy/triad on A100 and H100 report 0.8–0.9; not measured
  here);
- ``KERNEL_LAUNCH_S`` 5 µs: eager PyTorch's cost per operator on the host (dispatch and
  ``cudaLaunchKernel``), the floor a small kernel does not go below when the GPU waits on the
  host; a compiled block launches fewer, fused kernels, which the eager count does not see.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

__all__ = ["HBM_EFFICIENCY", "KERNEL_LAUNCH_S", "kernel_seconds", "non_gemm_seconds", "non_gemm_term",
           "gemm_constants"]

HBM_EFFICIENCY = 0.85
KERNEL_LAUNCH_S = 5e-6


def kernel_seconds(sizes: list[int], bandwidth: float, efficiency: float = HBM_EFFICIENCY,
                   launch: float = KERNEL_LAUNCH_S) -> float:
    """Seconds of kernels moving ``sizes`` bytes each at ``bandwidth × efficiency``, each at
    least ``launch``."""
    rate = bandwidth * efficiency
    return sum(max(b / rate, launch) for b in sizes)


def non_gemm_seconds(profile: dict[str, Any], device, efficiency: float = HBM_EFFICIENCY,
                     launch: float = KERNEL_LAUNCH_S) -> dict[str, float]:
    """``{seconds, kernels, bytes}`` of one step's memory-bound kernels on ``device`` from a
    :func:`~tpplan.analysis.memory.kernels.kernel_profile`: each trace priced, then
    extrapolated linearly over the model's periods of blocks (two traces) or taken whole.
    ValueError for a device without a memory bandwidth."""
    if not device.memory_bandwidth:
        raise ValueError(f"device {device.name} has no memory bandwidth: no non-GEMM term")
    accum, traces = profile["accum"], profile["traces"]

    def priced(kc) -> tuple[float, float, float]:
        return (kc.per_step(accum, lambda s: kernel_seconds(s, device.memory_bandwidth, efficiency, launch)),
                kc.per_step(accum, len), kc.per_step(accum, sum))

    figures = [priced(kc) for kc in traces]
    if len(figures) == 2:
        more = profile["periods"] - 1
        figures = [tuple(a + more * (b - a) for a, b in zip(*figures))]
    seconds, kernels, moved = figures[0]
    return dict(seconds=seconds, kernels=kernels, bytes=moved)


def non_gemm_term(result, device) -> dict[str, float] | None:
    """The non-GEMM term of ``result``'s step on ``device``: its traced kernels
    (``result.extra["kernels"]``, :func:`tpplan.analysis.analyses.analyze_kernels`) priced,
    ``{seconds, kernels, bytes, hbm_efficiency, launch_s}`` (a pipeline's: its busiest
    reported pp rank's, its stages' kernels summed, and ``pp_rank``); None where the dry run
    traced none (a failed trace, a caller that did not ask) or the device has no memory
    bandwidth: the step then keeps ``compute_efficiency`` for what is not a GEMM."""
    profile = result.extra.get("kernels")
    if not profile or "error" in profile or not device.memory_bandwidth:
        return None
    if "stages" not in profile:
        return dict(non_gemm_seconds(profile, device), hbm_efficiency=HBM_EFFICIENCY, launch_s=KERNEL_LAUNCH_S)
    # A pipeline: each pp rank runs its stages' kernels; the busiest rank's sets the step.
    stage = {i: non_gemm_seconds(p, device) for i, p in profile["stages"].items()}
    ranks = {r: {k: sum(stage[i][k] for i in mine) for k in ("seconds", "kernels", "bytes")}
             for r, mine in profile["ranks"].items()}
    busiest = max(ranks, key=lambda r: ranks[r]["seconds"])
    return dict(ranks[busiest], pp_rank=busiest, hbm_efficiency=HBM_EFFICIENCY, launch_s=KERNEL_LAUNCH_S)


def gemm_constants(c, traced: bool):
    """The constants the GEMM term runs under: with the non-GEMM term traced (``traced``),
    each GEMM at its own measured rate (``compute_efficiency`` 1: ``gemm_fraction`` × its
    shape's ``f``), the rest priced by the term; without, ``c`` as given, its
    ``compute_efficiency`` (0.625 by default) standing for everything that is not a GEMM."""
    return replace(c, compute_efficiency=1.0) if traced else c
