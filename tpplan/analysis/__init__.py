"""Analyses ``tpplan validate`` runs inside its dry run: memory and communication per rank.

Each analysis is a callable ``(DryRun) -> None`` that adds its result to ``DryRun.extra``
(merged into ``--json``) and a renderer to ``DryRun.extra["_renderers"]`` (printed after
the table). They run while the dry run's fake process group is up.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from .comm import diagnose, fsdp_collectives, megatron_minimum, rows, wire_bytes
from .memory import memory_per_rank
from .settings import step_shape
from .tptrace import trace_tp

__all__ = ["ANALYSES", "analyze_memory", "analyze_comm"]


def _renderers(result) -> list:
    return result.extra.setdefault("_renderers", [])


def _size(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def analyze_memory(result) -> None:
    """``memory_per_rank``: bytes per rank by part (docs/dry-run.md has the formulas)."""
    res = result.report.resolution
    shape = step_shape(result.plan, res.dims.dp)
    mem = memory_per_rank(result.model, result.plan, res, shape)
    result.extra["memory_per_rank"] = mem

    def render(console) -> None:
        from rich.table import Table

        b = mem["batch"]
        t = Table(title=f"memory per rank (micro-batch {b['micro_batch_size']} × seq "
                        f"{b['seq_len']}, {b['compute_dtype']} compute, AdamW)",
                  header_style="bold")
        t.add_column("part")
        t.add_column("bytes", justify="right")
        for part in ("parameters", "gradients", "optimizer", "fsdp_unsharded", "activations",
                     "total"):
            t.add_row(part, _size(mem[part]))
        console.print(t)

    _renderers(result).append(render)


def analyze_comm(result) -> None:
    """``comm_per_step`` (TP traced on meta, FSDP from its units) and ``comm_minimum``."""
    from ..models import build_model

    plan, res, dims = result.plan, result.report.resolution, result.report.dims
    shape = step_shape(plan, dims.dp)
    if dims.tp > 1:
        trace = trace_tp(plan, res, result.mesh, lambda: build_model(plan.model, "meta"),
                         shape.seq_len, shape.micro_batch, shape.param_dtype)
    else:
        from .tptrace import TPTrace
        trace = TPTrace(Counter(), [], None)
    fsdp = fsdp_collectives(result.model, res, plan, shape)
    per_step = rows(trace, fsdp, shape, dims)
    by_module: dict[tuple, list[int]] = {}
    for (kind, _dim, bw, nbytes, module), n in trace.counts.items():
        a = by_module.setdefault((module, "backward" if bw else "forward", kind), [0, 0])
        a[0] += n * shape.grad_accum
        a[1] += n * nbytes * shape.grad_accum
    result.extra["comm_per_step"] = dict(
        grad_accum=shape.grad_accum, collectives=per_step,
        tp_by_module=[{"module": m, "pass": p, "kind": k, "count": v[0], "bytes": v[1]}
                      for (m, p, k), v in sorted(by_module.items())],
        traced_depths=trace.depths, repeated_blocks=trace.blocks)
    result.extra["comm_minimum"] = _minimum(result, trace, shape)
    result.extra["_tp_trace"] = trace  # private: the raw per-micro-batch counts, for tests
    _renderers(result).append(lambda console: _render_comm(console, result.extra))


def _minimum(result, trace, shape) -> dict[str, Any]:
    plan, res, dims = result.plan, result.report.resolution, result.report.dims
    counts, nbytes = megatron_minimum(result.model, res, plan, shape)
    measured_n: Counter = Counter()
    measured_b: Counter = Counter()
    for (kind, _dim, bw, b, _m), n in trace.counts.items():
        measured_n[(kind, bw)] += n
        measured_b[(kind, bw)] += n * b
    k = shape.grad_accum
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
    wire = sum(wire_bytes(kd, b, dims.tp) for (kd, _), b in nbytes.items()) * k
    wire_measured = sum(wire_bytes(kd, b, dims.tp) for (kd, _), b in measured_b.items()) * k
    return dict(mesh_dim="tp", style="sequence parallel" if plan.uses_sequence_parallel
                else "tensor parallel", collectives=minimum, wire_bytes=wire,
                measured_wire_bytes=wire_measured, at_minimum=not extra, extra=extra,
                reasons=diagnose(result.model, res, plan) if extra else [])


def _render_comm(console, extra: dict[str, Any]) -> None:
    from rich.table import Table
    from rich.text import Text

    comm, mini = extra["comm_per_step"], extra["comm_minimum"]
    t = Table(title=f"communication per rank per optimizer step ({comm['grad_accum']} "
                    "micro-batches)", header_style="bold")
    for col in ("source", "collective", "mesh dim", "count", "bytes", "wire bytes"):
        t.add_column(col, justify="right" if col in ("count", "bytes", "wire bytes") else "left")
    for r in comm["collectives"]:
        t.add_row(r["source"], r["kind"], r["mesh_dim"], str(r["count"]), _size(r["bytes"]),
                  _size(r["wire_bytes"]))
    console.print(t)
    if mini["at_minimum"]:
        console.print(f"[green]TP at the minimum[/green]: a Megatron-style {mini['style']} plan "
                      f"moves {_size(mini['wire_bytes'])} per rank per step over tp too")
        return
    console.print(f"[yellow]TP above the minimum[/yellow]: {_size(mini['measured_wire_bytes'])}"
                  f" per rank per step over tp, a Megatron-style {mini['style']} plan needs "
                  f"{_size(mini['wire_bytes'])}")
    for e in mini["extra"]:
        console.print(Text(f"  +{e['count']} {e['kind']} in {e['pass']} "
                           f"(+{_size(e['bytes'])})"))
    for r in mini["reasons"]:
        console.print(Text(f"  why: {r['reason']}"))


def _guarded(analysis, key: str):
    """Run ``analysis``; if the model cannot be analysed (a factory model whose forward does
    not take a batch of token ids, say), report why under ``key`` instead of a traceback:
    the plan itself was valid."""

    def run(result) -> None:
        try:
            analysis(result)
        except Exception as e:  # noqa: BLE001 - any failure here is reported, not raised
            message = f"{type(e).__name__}: {e}".splitlines()[0]
            result.extra[key] = {"error": message}
            _renderers(result).append(lambda console: console.print(
                f"[yellow]{key} not available[/yellow]: {message}", markup=True,
                highlight=False))

    run.__name__ = analysis.__name__
    return run


ANALYSES = [_guarded(analyze_memory, "memory_per_rank"), _guarded(analyze_comm, "comm_per_step")]
