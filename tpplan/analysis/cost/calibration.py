"""Fitting the cost model's constants to step times a user measured: what the runs can
tell apart, and nothing more.

A ``tpplan train`` run keeps ``metrics.jsonl`` in its run folder: one row per step with
``step_time_s``, ``tokens_per_s`` and ``tokens_per_s_per_device`` (so the world size is
their ratio). The run's layout is the plan next to it (``plan.yaml``, the resolved plan the
run used) unless one is given. Each run is dry-run once at its world size; the fit then
only re-evaluates :func:`estimate_step` (cheap) for candidate constants.

What is fitted. One step time is one number: it pins one constant. ``compute_efficiency``
is always fitted. A link's efficiency (``intra_node_efficiency``, ``inter_node_efficiency``)
is fitted too only when the runs tell it apart from compute: their sensitivities
``∂ log(step) / ∂ log(constant)`` (each run's share of time the constant scales), stacked
over the runs, must be independent -- the matrix's smallest singular value, over the
columns scaled to unit length, at least :data:`DISTINCT` -- which takes at least two runs
whose communication shares differ. The latencies (α) and the overlaps are never fitted:
the few layouts a user trains on one machine do not separate them from the bandwidths
(``scripts/calibrate_cpu.py`` measures gloo's α directly instead). The fit minimizes the
squared log ratio over the runs by coordinate descent, a golden-section search on each
fitted constant's logarithm in turn (one constant: solved exactly when reachable).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

from ...plan.devices import Device
from .step_time import CostConstants, estimate_step

__all__ = ["measured_step", "fit_compute_efficiency", "fit_report", "fittable", "DISTINCT"]

LOW, HIGH = 1e-6, 4.0  # the range searched (above 1: the device's peak was set too low)
DISTINCT = 0.05  # smallest singular value of the runs' sensitivities to fit a constant
LINKS = ("intra_node_efficiency", "inter_node_efficiency")


def measured_step(path: str | Path) -> dict[str, Any]:
    """The median step time of a run's ``metrics.jsonl`` (its first step, which pays for
    warm-up, and the steps ``--profile`` slowed left out when there are others), its world
    size and step count."""
    rows = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON line ({e.msg})") from None
    rows = [r for r in rows if "step_time_s" in r]
    rows = [r for r in rows if not r.get("profiled")] or rows
    if not rows:
        raise ValueError(f"{path}: no step_time_s in any row: not a tpplan train metrics.jsonl")
    steady = rows[1:] or rows
    r = rows[-1]
    world = round(r["tokens_per_s"] / r["tokens_per_s_per_device"])
    return dict(path=str(path), step_time=statistics.median(x["step_time_s"] for x in steady),
                steps=len(steady), world_size=world)


def _results(metrics_paths, plan_path, overrides, world_size):
    from ..analyses import ANALYSES
    from ..dryrun import dry_run

    out = []
    for p in metrics_paths:
        m = measured_step(p)
        plan = plan_path or str(Path(p).parent / "plan.yaml")
        r = dry_run(plan, world_size or m["world_size"], list(overrides), ANALYSES)
        if not r.ok:
            why = r.errors[0].message if r.errors else r.analysis_errors[0].message
            raise ValueError(f"{p}: the dry run of {plan} failed: {why}")
        out.append((m, r))
    return out


def _loss(runs, device, gpn, c: CostConstants) -> float:
    return sum(math.log(estimate_step(r, device, gpn, c).step_time / m["step_time"]) ** 2
               for m, r in runs)


def _sensitivity(runs, device, gpn, c: CostConstants, name: str) -> list[float]:
    """``-∂ log(step) / ∂ log(name)`` for each run: the share of its time ``name`` scales."""
    h = 1.01
    out = []
    for _, r in runs:
        base = estimate_step(r, device, gpn, c).step_time
        moved = estimate_step(r, device, gpn, replace(c, **{name: getattr(c, name) * h}))
        out.append(-math.log(moved.step_time / base) / math.log(h))
    return out


def fittable(runs, device, gpn: int, c: CostConstants) -> list[str]:
    """The constants the runs tell apart: ``compute_efficiency``, then each link efficiency
    whose sensitivity column keeps the stacked matrix's smallest singular value (columns
    scaled to unit length) at least :data:`DISTINCT`."""
    import numpy as np

    names = ["compute_efficiency"]
    cols = [_sensitivity(runs, device, gpn, c, names[0])]
    for link in LINKS:
        col = _sensitivity(runs, device, gpn, c, link)
        if max(col) < 1e-3:
            continue  # the runs do not use this link
        m = np.array(cols + [col]).T
        m = m / np.maximum(np.linalg.norm(m, axis=0), 1e-12)
        if len(runs) >= m.shape[1] and np.linalg.svd(m, compute_uv=False)[-1] >= DISTINCT:
            names.append(link)
            cols.append(col)
    return names


def _golden(f, lo: float, hi: float, iterations: int = 80) -> float:
    g = (math.sqrt(5) - 1) / 2
    lo, hi = math.log(lo), math.log(hi)
    for _ in range(iterations):
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        if f(math.exp(a)) <= f(math.exp(b)):
            hi = b
        else:
            lo = a
    return math.exp((lo + hi) / 2)


def _gauss_newton(runs, device, gpn, c: CostConstants, names: list[str]) -> CostConstants:
    """Coordinate descent's answer refined: Gauss-Newton steps on the log ratios in the
    logarithms of the fitted constants (a step kept only when it lowers the loss)."""
    import numpy as np

    def residuals(at: CostConstants) -> np.ndarray:
        return np.array([math.log(estimate_step(r, device, gpn, at).step_time / m["step_time"])
                         for m, r in runs])

    def moved(at: CostConstants, logs) -> CostConstants:
        return replace(at, **{n: min(HIGH, max(LOW, getattr(at, n) * math.exp(d)))
                              for n, d in zip(names, logs)})

    for _ in range(20):
        r0 = residuals(c)
        h = 1e-5
        jac = np.array([(residuals(moved(c, [h if j == i else 0.0 for j in range(len(names))]))
                         - r0) / h for i in range(len(names))]).T
        step = np.linalg.lstsq(jac, -r0, rcond=None)[0]
        trial = moved(c, step)
        if float(residuals(trial) @ residuals(trial)) >= float(r0 @ r0):
            break
        c = trial
    return c


def fit_report(metrics_paths: Sequence[str], plan_path: str | None, overrides: Sequence[str],
               device: Device, gpus_per_node: int, constants: CostConstants,
               world_size: int | None = None) -> tuple[CostConstants, list[dict[str, Any]]]:
    """The fitted constants and, per run, its measured and predicted step time (and, in
    ``fitted``, which constants were fitted: :func:`fittable`)."""
    runs = _results(metrics_paths, plan_path, overrides, world_size)
    names = fittable(runs, device, gpus_per_node, constants)
    c = constants
    for _ in range(1 if len(names) == 1 else 3):
        for name in names:
            def loss(v: float, name: str = name, at: CostConstants = c) -> float:
                return _loss(runs, device, gpus_per_node, replace(at, **{name: v}))

            c = replace(c, **{name: _golden(loss, LOW, HIGH)})
    if len(names) > 1:
        c = _gauss_newton(runs, device, gpus_per_node, c, names)
    paths = ", ".join(str(p) for p in metrics_paths)
    fitted = replace(c, source=f"calibrated from {paths} ({', '.join(names)} fitted; the "
                               f"others from {constants.source})")
    report = []
    for m, r in runs:
        e = estimate_step(r, device, gpus_per_node, fitted)
        report.append(dict(path=m["path"], world_size=m["world_size"], steps=m["steps"],
                           mesh=r.resolution.dims.as_dict(), measured=m["step_time"],
                           predicted=e.step_time, ratio=e.step_time / m["step_time"],
                           fitted=names))
    return fitted, report


def fit_compute_efficiency(metrics_paths, plan_path, overrides, device, gpus_per_node,
                           constants, world_size=None) -> CostConstants:
    """The constants :func:`fit_report` fits (``compute_efficiency`` always, a link's
    efficiency when the runs tell it apart)."""
    if isinstance(metrics_paths, (str, Path)):
        metrics_paths = [metrics_paths]
    return fit_report(metrics_paths, plan_path, overrides, device, gpus_per_node, constants,
                      world_size)[0]
