"""The analysis layer: what a plan costs and whether it computes the right thing.

``dryrun`` (apply at any world size on meta tensors and a fake process group), ``counting``
(collectives with their sizes), ``tptrace`` (TP collectives of one micro-batch, traced),
``comm`` (communication per step and the Megatron minimum), ``memory`` (bytes per rank)
and ``numerics`` (``tpplan verify``: a real gloo run against one device). The analyses
``tpplan validate`` runs are :data:`ANALYSES`; each adds its figures to ``DryRun.extra``.
Imports the plan, models and parallel layers and the façade; not the trainer or byom.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from ..models import build_model
from ..plan.specs import torch_dtype
from .comm import diagnose, fsdp_collectives, megatron_minimum, rows, wire_bytes
from .dryrun import Analysis, DryRun
from .memory import memory_per_rank
from .tptrace import TPTrace, trace_tp

__all__ = ["ANALYSES", "analyze_memory", "analyze_comm"]


def analyze_memory(result: DryRun) -> None:
    """``memory_per_rank``: bytes per rank by part (docs/dry-run.md has the formulas)."""
    result.extra["memory_per_rank"] = memory_per_rank(result.model, result.plan.spec,
                                                      result.report.resolution, result.step,
                                                      result.fsdp_units)


def analyze_comm(result: DryRun) -> None:
    """``comm_per_step`` (TP traced on meta, FSDP from its units) and ``comm_minimum``."""
    spec, res, shape = result.plan.spec, result.report.resolution, result.step
    dims = res.dims
    if dims.tp > 1:
        trace = trace_tp(spec, res, result.mesh, lambda: build_model(spec.model, "meta"),
                         shape.seq_len, shape.micro_batch, torch_dtype(shape.param_dtype))
    else:
        trace = TPTrace(Counter(), [], None)
    result.tp_trace = trace
    fsdp = fsdp_collectives(result.fsdp_units, spec.fsdp, shape, dims)
    by_module: dict[tuple, list[int]] = {}
    for (kind, _dim, bw, nbytes, module), n in trace.counts.items():
        a = by_module.setdefault((module, "backward" if bw else "forward", kind), [0, 0])
        a[0] += n * shape.grad_accum
        a[1] += n * nbytes * shape.grad_accum
    result.extra["comm_per_step"] = dict(
        grad_accum=shape.grad_accum, collectives=rows(trace, fsdp, shape, dims),
        tp_by_module=[{"module": m, "pass": p, "kind": k, "count": v[0], "bytes": v[1]}
                      for (m, p, k), v in sorted(by_module.items())],
        traced_depths=trace.depths, repeated_blocks=trace.blocks)
    result.extra["comm_minimum"] = _minimum(result, trace)


def _minimum(result: DryRun, trace: TPTrace) -> dict[str, Any]:
    spec, res, shape = result.plan.spec, result.report.resolution, result.step
    counts, nbytes = megatron_minimum(result.model, res, spec, shape)
    measured_n: Counter = Counter()
    measured_b: Counter = Counter()
    for (kind, _dim, bw, b, _m), n in trace.counts.items():
        measured_n[(kind, bw)] += n
        measured_b[(kind, bw)] += n * b
    k = shape.grad_accum
    tp = res.dims.tp
    keys = sorted(set(counts) | set(measured_n))
    minimum, extra = [], []
    for kind, bw in keys:
        p = "backward" if bw else "forward"
        minimum.append({"kind": kind, "pass": p, "count": counts[(kind, bw)] * k,
                        "bytes": nbytes[(kind, bw)] * k})
        dn = measured_n[(kind, bw)] - counts[(kind, bw)]
        db = measured_b[(kind, bw)] - nbytes[(kind, bw)]
        if dn > 0 or db > 0:
            extra.append({"kind": kind, "pass": p, "count": dn * k, "bytes": db * k})
    wire = sum(wire_bytes(kd, b, tp) for (kd, _), b in nbytes.items()) * k
    wire_measured = sum(wire_bytes(kd, b, tp) for (kd, _), b in measured_b.items()) * k
    return dict(mesh_dim="tp", style="sequence parallel" if spec.uses_sequence_parallel
                else "tensor parallel", collectives=minimum, wire_bytes=wire,
                measured_wire_bytes=wire_measured, at_minimum=not extra, extra=extra,
                reasons=diagnose(result.model, res, spec) if extra else [])


ANALYSES: list[Analysis] = [("memory_per_rank", analyze_memory), ("comm_per_step", analyze_comm)]
