"""Fitting the cost model's compute efficiency to step times a user measured.

A ``tpplan train`` run keeps ``metrics.jsonl`` in its run folder: one row per step with
``step_time_s``, ``tokens_per_s`` and ``tokens_per_s_per_device`` (so the world size is
their ratio). The run's layout is the plan next to it (``plan.yaml``, the resolved plan the
run used) unless one is given. Each run is dry-run once at its world size; the fit then
only re-evaluates :func:`estimate_step` (cheap) for each candidate efficiency.

Only ``compute_efficiency`` is fitted: one step time per run cannot separate compute from
communication efficiency (both only scale seconds), and the few layouts a user trains on
one machine do not pin the overlap constants. The other constants stay as given.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

from ..plan.devices import Device
from .cost import CostConstants, estimate_step

__all__ = ["measured_step", "fit_compute_efficiency", "fit_report"]

LOW, HIGH = 1e-6, 4.0  # the range searched (above 1: the device's peak was set too low)


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
    from . import ANALYSES
    from .dryrun import dry_run

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


def _loss(runs, device, gpn, c: CostConstants, eff: float) -> float:
    ce = replace(c, compute_efficiency=eff)
    return sum(math.log(estimate_step(r, device, gpn, ce).step_time / m["step_time"]) ** 2
               for m, r in runs)


def fit_report(metrics_paths: Sequence[str], plan_path: str | None, overrides: Sequence[str],
               device: Device, gpus_per_node: int, constants: CostConstants,
               world_size: int | None = None) -> tuple[CostConstants, list[dict[str, Any]]]:
    """The fitted constants and, per run, its measured and predicted step time. The fit
    minimizes the squared log ratio over the runs (one run: solved exactly when reachable)
    by golden-section search on ``log(efficiency)``."""
    runs = _results(metrics_paths, plan_path, overrides, world_size)
    lo, hi = math.log(LOW), math.log(HIGH)
    g = (math.sqrt(5) - 1) / 2
    for _ in range(100):
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        if _loss(runs, device, gpus_per_node, constants, math.exp(a)) <= \
                _loss(runs, device, gpus_per_node, constants, math.exp(b)):
            hi = b
        else:
            lo = a
    eff = math.exp((lo + hi) / 2)
    paths = ", ".join(str(p) for p in metrics_paths)
    fitted = replace(constants, compute_efficiency=eff,
                     source=f"calibrated from {paths} (compute_efficiency fitted; the "
                            f"others from {constants.source})")
    report = []
    for m, r in runs:
        e = estimate_step(r, device, gpus_per_node, fitted)
        report.append(dict(path=m["path"], world_size=m["world_size"], steps=m["steps"],
                           mesh=r.resolution.dims.as_dict(), measured=m["step_time"],
                           predicted=e.step_time, ratio=e.step_time / m["step_time"]))
    return fitted, report


def fit_compute_efficiency(metrics_paths, plan_path, overrides, device, gpus_per_node,
                           constants, world_size=None) -> CostConstants:
    if isinstance(metrics_paths, (str, Path)):
        metrics_paths = [metrics_paths]
    return fit_report(metrics_paths, plan_path, overrides, device, gpus_per_node, constants,
                      world_size)[0]
