"""The non-GEMM term against measured steps: the recorded H200 rows (docs/benchmarks.md, "On a
GPU") and the published rows without a pipeline (scripts/cost_vs_published.py's CONFIGS).

For each row: the estimate as `validate --device` makes it today (``compute_efficiency``
0.625, no non-GEMM term), and the estimate with the GEMMs at their own rate
(``compute_efficiency`` 1: ``gemm_fraction`` × each GEMM's shape term) plus the traced step's
memory-bound kernels priced by tpplan.analysis.cost.non_gemm (data-sheet HBM bandwidth at
0.85, 5 µs a kernel; nothing fitted to these rows). Usage:

    PYTHONPATH=. python scripts/non_gemm_rows.py [--only NAME]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from dataclasses import replace

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))

from cost_vs_published import CONFIGS, DEVICE_OF, measured_seconds  # noqa: E402

from tpplan.analysis import ANALYSES  # noqa: E402
from tpplan.analysis.analyses import analyze_kernels  # noqa: E402
from tpplan.analysis.cost.non_gemm import non_gemm_seconds  # noqa: E402
from tpplan.analysis.cost.step_time import DEFAULT_CONSTANTS, estimate_step  # noqa: E402
from tpplan.analysis.dryrun import dry_run  # noqa: E402

BF16 = "fsdp.mixed_precision={param_dtype: bfloat16, reduce_dtype: float32}"
ONEB = ["model.config=1b", "train.seq_len=2048", "train.global_batch_size=4", "train.micro_batch_size=1",
        "mesh.tp=1", BF16]
# name, plan, world, --set lines, measured seconds per step (docs/benchmarks.md, 2026-11-26)
H200_ROWS = [
    ("H200 1b eager (gpu_check)", 1, ONEB, 8192 / 21_644),
    ("H200 1b eager (second run)", 1, ONEB, 8192 / 19_864),
    ("H200 1b eager (whole gpu_check run)", 1, ONEB, 8192 / 24_950),
    ("H200 1b torch.compile", 1, ONEB, 8192 / 25_760),
    ("H200 debug model, fp32 (Quickstart, world 1)", 1, ["mesh.tp=1"], 2048 / 69_049),
]


def row(name: str, device, world: int, sets: list[str], measured) -> str:
    t0 = time.perf_counter()
    r = dry_run("plans/llama.yaml", world, sets, ANALYSES + [("kernels", analyze_kernels)])
    if not r.ok:
        return f"| {name} | error: {(r.errors or r.analysis_errors)[0]} |"
    old = estimate_step(r, device)
    gemm = estimate_step(r, device, constants=replace(DEFAULT_CONSTANTS, compute_efficiency=1.0))
    seconds = measured(old) if callable(measured) else measured
    if "kernels" not in r.extra:
        return f"| {name} | {seconds:.3f} s | {old.step_time:.3f} s ({old.step_time / seconds:.2f}) | n/a (pipeline) |"
    ng = non_gemm_seconds(r.extra["kernels"], device)
    new = gemm.step_time + ng["seconds"]
    return (f"| {name} | {seconds * 1e3:,.1f} ms | {old.step_time * 1e3:,.1f} ms | {old.step_time / seconds:.2f} | "
            f"{gemm.step_time * 1e3:,.1f} + {ng['seconds'] * 1e3:,.1f} ms ({ng['kernels']:,.0f} kernels, "
            f"{ng['bytes'] / 1e9:,.1f} GB) | {new * 1e3:,.1f} ms | {new / seconds:.2f} | "
            f"{time.perf_counter() - t0:.0f} s |")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=None)
    a = ap.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"load {os.getloadavg()[0]:.2f}", file=sys.stderr)
    print("| row | measured step | estimate today | ratio | GEMMs + non-GEMM | new estimate | ratio | dry run |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, world, sets, seconds in H200_ROWS:
        if a.only is None or a.only in name:
            print(row(name, DEVICE_OF["h200"], world, sets, seconds), flush=True)
    for name, _, device, world, sets, (kind, value) in CONFIGS:
        if any("pipeline" in s for s in sets) or (a.only is not None and a.only not in name):
            continue
        print(row(name, DEVICE_OF[device], world, sets,
                  lambda est, k=kind, v=value, w=world: measured_seconds(k, v, est, w)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
