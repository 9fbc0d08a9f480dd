"""A run folder as data: its metrics over steps and the plan it ran, dry-run again.

``tpplan train`` leaves ``metrics.jsonl`` (one JSON object per logged step: ``step``,
``loss``, ``grad_norm``, ``lr``, ``tokens_per_s``, ... and ``eval_loss`` when the run
evaluates) and ``plan.yaml`` (the resolved plan) in its run folder. The plan is dry-run at
the run's world size, so the report shows the mesh, memory and communication it ran with.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["RunError", "replica_groups", "run_metrics", "run_report", "world_size_of"]


class RunError(Exception):
    """The folder is not a run folder (no metrics), or its metrics cannot be read."""


def _metrics(path: Path) -> tuple[list[dict[str, Any]], int]:
    rows, skipped = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:  # a run killed mid-write leaves half a line
            skipped += 1
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
        else:
            skipped += 1
    return sorted(rows, key=lambda r: r["step"]), skipped


def _json(path: Path) -> Any:
    """A JSON file tpplan train wrote (``estimate.json``: the dry run against the run,
    ``profile/summary-rank<R>.json``: a profile's table), or None."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_metrics(folder: Path) -> tuple[list[dict[str, Any]], int]:
    """A run folder's metrics rows by step, and the number of lines that could not be read."""
    return _metrics(folder / "metrics.jsonl")


def replica_groups(folder: Path, rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A fault-tolerant run's rows and events (docs/fault-tolerance.md): group 0's rows (the
    run folder's), with the steps it missed while it was down taken from the other groups'
    (``replica-g/metrics.jsonl``; every group logs the quorum's loss), and each group's
    ``fault`` / ``rejoin`` / ``recovered`` events once per step, in step order."""
    by_step = {r["step"]: r for r in rows}
    events: dict[tuple[int, str], dict[str, Any]] = {}
    for group_rows in [rows, *(_metrics(p)[0] for p in sorted(folder.glob("replica-*/metrics.jsonl")))]:
        for r in group_rows:
            by_step.setdefault(r["step"], r)
            if isinstance(r.get("event"), str):
                events.setdefault((r["step"], r["event"]), {"step": r["step"], "event": r["event"],
                                                             "replicas": r.get("replicas")})
    return [by_step[s] for s in sorted(by_step)], [events[k] for k in sorted(events)]


def world_size_of(rows: list[dict[str, Any]]) -> int | None:
    """The run's world size, from its own figures: tokens/s over tokens/s per device."""
    for row in reversed(rows):
        total, per = row.get("tokens_per_s"), row.get("tokens_per_s_per_device")
        if isinstance(total, (int, float)) and isinstance(per, (int, float)) and per > 0:
            return round(total / per)
    return None


def run_report(run_dir: str | Path, world_size: int | None = None) -> dict[str, Any]:
    """``{"run": {...metrics, plan...}, "plan": <validate --json of plan.yaml> | None,
    "plan_error": str | None}``; :class:`RunError` for a folder without metrics."""
    from ..analyses import ANALYSES
    from ..dryrun import dry_run

    folder = Path(run_dir)
    metrics = folder / "metrics.jsonl"
    if not metrics.is_file():
        raise RunError(f"{folder}: no metrics.jsonl here; a run folder is what "
                       "`tpplan train` writes (metrics.run_dir, default runs/<plan name>)")
    rows, skipped = _metrics(metrics)
    rows, events = replica_groups(folder, rows)
    plan_file = folder / "plan.yaml"
    plan_yaml = plan_file.read_text() if plan_file.is_file() else None
    source = None
    if plan_yaml and plan_yaml.startswith("# resolved from "):
        source = plan_yaml.splitlines()[0].removeprefix("# resolved from ").strip()
    world = world_size or world_size_of(rows)
    out: dict[str, Any] = {"run": dict(dir=str(folder), metrics=rows, events=events, skipped_lines=skipped,
                                       plan_yaml=plan_yaml, plan_source=source, world_size=world,
                                       estimate=_json(folder / "estimate.json"),
                                       profile=[_json(p) for p in sorted(
                                           (folder / "profile").glob("summary-rank*.json"))]),
                           "plan": None, "plan_error": None}
    if plan_yaml is None:
        out["plan_error"] = f"{plan_file}: not found"
    elif world is None:
        out["plan_error"] = "the run's world size is not in its metrics: pass --world-size"
    else:
        result = dry_run(str(plan_file), world, (), ANALYSES)
        out["plan"] = result.to_json()
    return out
