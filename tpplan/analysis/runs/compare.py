"""Runs side by side: their curves, how their plans differ, and the first step where their
losses part.

Which runs must agree, and how closely (docs/training.md, "Runs side by side"):

- **Exactly** (tolerance 0): runs of the same resolved plan -- same mesh degrees at the same
  world size, same styles, batch, seed and data -- on the same machine, including a run
  resumed from its own checkpoint: the same operations in the same order, bit for bit.
- **To fp32 rounding** (:data:`FP32_TOLERANCE`, relative): the same model, seed and batch on
  another layout (tp, dp, pp degrees, FSDP units, accumulation): each layout sums partial
  results in its own order, so the losses differ in the last bits from the first step and
  the difference grows slowly with training. 1e-4 is what ``tests/test_train.py`` holds
  every mesh shape to over its steps.
- A different seed, batch or data is a different run: it parts at its first step.

The first run given is the baseline; each other run is compared with it on the steps both
logged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from .report import RunError, run_metrics, world_size_of

__all__ = ["FP32_TOLERANCE", "IGNORED", "compare_runs", "first_parting"]

FP32_TOLERANCE = 1e-4
FLOOR = 1e-3  # relative differences are taken against at least this loss
# Keys that say where a run writes or how it reports, not what it computes.
IGNORED = ("metrics.", "checkpoint.")
SERIES = ("loss", "eval_loss", "tokens_per_s", "grad_norm")


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def _run(folder: Path) -> dict[str, Any]:
    import yaml

    rows, skipped = run_metrics(folder)
    plan_file = folder / "plan.yaml"
    plan = yaml.safe_load(plan_file.read_text()) if plan_file.is_file() else None
    world = world_size_of(rows)
    mesh = None
    if plan_file.is_file() and world:
        from ...api import load
        from ...plan import PlanErrors

        try:
            mesh = load(str(plan_file)).parallel_dims(world).as_dict()
        except PlanErrors:
            mesh = None
    return {"dir": str(folder), "metrics": rows, "skipped_lines": skipped,
            "world_size": world, "mesh": mesh, "plan": plan or {}}


def first_parting(base: list[dict], other: list[dict], tolerance: float) -> dict[str, Any]:
    """The first step both runs logged where their losses differ by more than
    ``tolerance`` relative to the baseline's (at least :data:`FLOOR`); ``step`` None when
    they agree on every common step."""
    theirs = {r["step"]: r["loss"] for r in other if isinstance(r.get("loss"), (int, float))}
    common, worst = 0, 0.0
    for r in base:
        if r["step"] not in theirs or not isinstance(r.get("loss"), (int, float)):
            continue
        common += 1
        a, b = r["loss"], theirs[r["step"]]
        rel = abs(b - a) / max(abs(a), FLOOR)
        worst = max(worst, rel)
        if rel > tolerance:
            return {"step": r["step"], "base_loss": a, "loss": b, "relative": rel,
                    "common_steps": common}
    return {"step": None, "common_steps": common, "largest_relative": worst}


def compare_runs(dirs: Sequence[str | Path], tolerance: float | None = None) -> dict[str, Any]:
    """``{"runs": [...], "differences": [...], "partings": [...]}`` for run folders, the
    first the baseline. ``tolerance`` None: 0 for runs of the same resolved plan at the same
    world size, :data:`FP32_TOLERANCE` otherwise (the module docstring says why)."""
    runs = []
    for d in dirs:
        folder = Path(d)
        if not (folder / "metrics.jsonl").is_file():
            raise RunError(f"{folder}: no metrics.jsonl here; a run folder is what "
                           "`tpplan train` writes")
        runs.append(_run(folder))
    flats = [{k: v for k, v in _flat(r["plan"]).items() if not k.startswith(IGNORED)}
             for r in runs]
    keys = sorted(set().union(*flats))
    differences = [{"key": k, "values": [f.get(k) for f in flats]} for k in keys
                   if any(f.get(k) != flats[0].get(k) for f in flats)]
    meshes = [r["mesh"] for r in runs]
    if any(m != meshes[0] for m in meshes):
        differences.insert(0, {"key": "mesh (at the run's world size)", "values": meshes})
    partings = []
    for i, r in enumerate(runs[1:], 1):
        same = flats[i] == flats[0] and r["world_size"] == runs[0]["world_size"]
        tol = tolerance if tolerance is not None else (0.0 if same else FP32_TOLERANCE)
        why = ("given" if tolerance is not None else
               "the same plan and world size: identical" if same else
               "another layout or plan: fp32 rounding")
        partings.append({"run": r["dir"], "tolerance": tol, "why": why,
                         **first_parting(runs[0]["metrics"], r["metrics"], tol)})
    return {"runs": runs, "baseline": runs[0]["dir"], "series": list(SERIES),
            "differences": differences, "partings": partings}
