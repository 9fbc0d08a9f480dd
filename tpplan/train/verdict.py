"""The dry run against the run: its peak per rank and step time next to what was measured.

At the end of ``tpplan train`` rank 0 prints both in the summary table and records them in
``<run_dir>/estimate.json`` (read by ``tpplan report`` and by ``tpplan validate
--calibrate RUN_DIR``). The figures:

- **memory**: the dry run's peak per rank (the largest over the ranks) against the
  measured peak, the largest over the ranks (:mod:`.memwatch` says what is measured on CUDA
  and on CPU). Agreement is ``measured / predicted`` within :data:`MEMORY_TOLERANCE`; on
  CPU a peak below :data:`CPU_MEMORY_FLOOR` is too small for the resident set to tell.
- **step time**: the cost model's estimate (``tpplan validate --device``; only where the
  device is a preset, e.g. an H100 -- a CPU has none) against the mean measured step,
  the first step and profiled steps left out.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CPU_MEMORY_FLOOR", "ESTIMATE_FILE", "MEMORY_TOLERANCE", "Check", "compare_estimate",
           "read_estimate", "settle", "write_estimate"]

ESTIMATE_FILE = "estimate.json"
# measured / predicted peak. CPU: the resident set also holds the allocator's small blocks,
# Python objects and gloo's buffers, never counted as tensors; the README's runs read
# 0.92-0.98 (docs/training.md, "The dry run against the run").
MEMORY_TOLERANCE = (0.85, 1.15)
# The CPU resident set resolves a step's peak to a few MiB only: it also holds what the step
# allocates that is not a tensor (Python objects and caches made on first use, gloo's
# buffers) and glibc serves blocks under the 64 KiB mmap threshold from its heap, reusing
# freed ones. On the README's tiny Qwen3-MoE (ep 4, 4 ranks), whose tensors the dry run
# predicts within 0.7% (FSDPMemTracker, tests/memory_measure.py), the first step read
# +1.7 MiB at a 1.9 MiB peak, +0.8 at 3.0, -2.2 at 9.8 and -3.3 at 18.9 (docs/training.md):
# 3.3 MiB is 15% of 22 MiB, so below 24 MiB the ratio says nothing about the dry run.
# CUDA's max_memory_allocated counts tensors alone: no floor there.
CPU_MEMORY_FLOOR = 24 * 2 ** 20


def _mib(n: float) -> str:
    return f"{n / 2 ** 20:.1f} MiB"


@dataclass
class Check:
    rows: dict[str, str] = field(default_factory=dict)  # for the summary table
    record: dict[str, Any] = field(default_factory=dict)  # estimate.json


def settle(run_dir: Path, predicted: dict[str, Any] | None, measured_peak: int | None,
           step_time: float, memory, sinks) -> dict[str, str]:
    """Rank 0 at the end of a run: the comparison recorded in the run folder and given to
    the sinks; returns the summary table's rows."""
    import torch.distributed as dist

    check = compare_estimate(predicted, measured_peak, step_time, dist.get_world_size(),
                             memory.device_type, memory.how)
    write_estimate(run_dir, check.record)
    text = "\n\n".join(f"{k}: {v}" for k, v in check.rows.items())
    sinks.text("dry_run", f"{text}\n\n```json\n{json.dumps(check.record, indent=1)}\n```",
               check.record)
    return check.rows


def compare_estimate(predicted: dict[str, Any] | None, measured_peak: int | None,
                     step_time: float, world: int, device_type: str, how: str) -> Check:
    """The summary rows and the record; ``predicted`` as ``analysis.runs.expected.estimate`` returns it."""
    c = Check()
    c.record = {"world_size": world, "device_type": device_type,
                "measured": {"peak_bytes": measured_peak, "how": how,
                             "step_time_s": step_time},
                "dry_run": predicted, "memory_tolerance": list(MEMORY_TOLERANCE)}
    if predicted is None:
        c.rows["dry run"] = ("not run (metrics.dry_run: false; or train() was given no estimate, "
                             "or was called with its caller's process group already up)")
        return c
    if predicted.get("error"):
        c.rows["dry run"] = f"could not run: {predicted['error']}"
        return c
    peak = predicted.get("peak_bytes")
    if peak and measured_peak is not None and device_type == "cpu" and \
            max(peak, measured_peak) < CPU_MEMORY_FLOOR:
        ratio = measured_peak / peak
        c.record.update(memory_ratio=ratio, memory_agrees=None,
                        memory_floor_bytes=CPU_MEMORY_FLOOR)
        c.rows["dry run's peak per rank"] = (
            f"{_mib(peak)}: measured ×{ratio:.2f}, too small to compare: under "
            f"{_mib(CPU_MEMORY_FLOOR)} the CPU resident set's own part (Python objects, "
            "caches made on first use, the allocator's small blocks: a few MiB either way) "
            f"moves the ratio past {MEMORY_TOLERANCE[0]}–{MEMORY_TOLERANCE[1]}")
    elif peak and measured_peak is not None:
        ratio = measured_peak / peak
        ok = MEMORY_TOLERANCE[0] <= ratio <= MEMORY_TOLERANCE[1]
        c.record["memory_ratio"], c.record["memory_agrees"] = ratio, ok
        c.rows["dry run's peak per rank"] = (
            f"{_mib(peak)}: measured ×{ratio:.2f}, " + ("within" if ok else "OUTSIDE")
            + f" {MEMORY_TOLERANCE[0]}–{MEMORY_TOLERANCE[1]}")
    elif peak:
        c.rows["dry run's peak per rank"] = f"{_mib(peak)}; not measured on this system"
    est = predicted.get("step_time_s")
    if est:
        c.record["step_time_ratio"] = step_time / est
        c.rows["step time vs estimate"] = (
            f"{step_time:.3g} s measured vs {est:.3g} s estimated on "
            f"{predicted.get('device')}: ×{step_time / est:.2f}")
    else:
        c.rows["step time vs estimate"] = predicted.get("step_time_note", "no estimate")
    return c


def write_estimate(run_dir: Path, record: dict[str, Any]) -> None:
    tmp = run_dir / f"{ESTIMATE_FILE}.tmp"
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, run_dir / ESTIMATE_FILE)


def read_estimate(run_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((Path(run_dir) / ESTIMATE_FILE).read_text())
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None
