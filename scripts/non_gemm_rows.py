"""The step time `validate --device` prints, before and after the non-GEMM term, against every
recorded and published row: the H200 rows (docs/benchmarks.md, "On a GPU (one H200)") and the
published runs of scripts/cost_vs_published.py's CONFIGS (docs/search.md).

"before": GEMMs at ``compute_efficiency`` 0.625 of their rate, standing for every other kernel
(the estimate until this term). "after": the estimate as `validate` and `search` make it now,
GEMMs at their own rate (``gemm_fraction`` × each shape's term) plus the traced step's
memory-bound kernels (tpplan/analysis/cost/non_gemm.py: data-sheet HBM bandwidth × 0.85, 5 µs a
kernel; nothing fitted to these rows). A pipeline's stages are not traced for kernels yet:
its rows keep the constant ("constant" in the last column). Ratio: estimated / measured step.
Every row runs the plain cross-entropy (``train.loss_chunk=0``), as the measured runs did.
Usage:

    PYTHONPATH=. python scripts/non_gemm_rows.py [--only NAME]
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import sys
import time
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))

from cost_vs_published import CONFIGS, DEVICE_OF, measured_seconds  # noqa: E402

from tpplan.analysis import ANALYSES  # noqa: E402
from tpplan.analysis.analyses import analyze_kernels  # noqa: E402
from tpplan.analysis.cost.step_time import estimate_step  # noqa: E402
from tpplan.analysis.dryrun import dry_run  # noqa: E402

PLAIN_LOSS = "train.loss_chunk=0"  # every measured run below predates the chunked loss
BF16 = "fsdp.mixed_precision={param_dtype: bfloat16, reduce_dtype: float32}"
ONEB = ["model.config=1b", "train.seq_len=2048", "train.global_batch_size=4", "train.micro_batch_size=1",
        "mesh.tp=1", BF16]
H200 = "docs/benchmarks.md, 'On a GPU (one H200)', 2026-11-26"
# name, source, device, world, --set lines, measured (as cost_vs_published's CONFIGS)
H200_ROWS = [
    ("H200 1b eager (gpu_check)", H200, "h200", 1, ONEB, ("tps", 21_644)),
    ("H200 1b eager (second run)", H200, "h200", 1, ONEB, ("tps", 19_864)),
    ("H200 1b eager (whole gpu_check run)", H200, "h200", 1, ONEB, ("tps", 24_950)),
    ("H200 1b torch.compile", H200, "h200", 1, ONEB, ("tps", 25_760)),
    ("H200 debug model, fp32 (Quickstart, world 1)", H200, "h200", 1, ["mesh.tp=1"], ("seconds", 2048 / 69_049)),
]
ROWS = H200_ROWS + CONFIGS


@functools.lru_cache(maxsize=None)
def estimates(plan: str, dev: str, world: int, sets: tuple[str, ...]) -> tuple[Any, Any, bool, float]:
    """``(after, before, traced, seconds)``: the estimate with the traced non-GEMM term (as
    `validate --device` makes it), the one without (the constant's), whether kernels were
    traced, and the dry run's seconds; one dry run per layout (rows of one layout share it)."""
    device, t0 = DEVICE_OF[dev], time.perf_counter()
    r = dry_run(plan, world, [*sets, PLAIN_LOSS], ANALYSES + [("kernels", analyze_kernels)])
    if not r.ok:
        raise RuntimeError(f"{sets}: {(r.errors or r.analysis_errors)[0].message}")
    after = estimate_step(r, device)
    kernels = r.extra.pop("kernels", None)
    return after, estimate_step(r, device), kernels is not None, time.perf_counter() - t0


def step_row(row: tuple, plan: str = "plans/llama.yaml") -> dict[str, Any]:
    """One row's measured step and the estimate before and after the non-GEMM term."""
    name, source, dev, world, sets, (kind, value) = row
    after, before, traced, seconds = estimates(plan, dev, world, tuple(sets))
    measured = measured_seconds(kind, value, after, world)
    ng = after.details["non_gemm"]
    return dict(name=name, source=source, measured=measured, before=before.step_time, after=after.step_time,
                ratio_before=before.step_time / measured, ratio_after=after.step_time / measured,
                gemms=after.terms["compute"] + after.terms["recompute"], non_gemm=ng,
                traced=traced, seconds=seconds)


def _ms(s: float) -> str:
    return f"{s * 1e3:,.1f} ms" if s < 10 else f"{s:,.2f} s"


def markdown(d: dict[str, Any]) -> str:
    ng = d["non_gemm"]
    how = (f"{_ms(d['gemms'])} + {_ms(ng['seconds'])} ({ng['kernels']:,.0f} kernels, {ng['bytes'] / 1e9:,.0f} GB)"
           if ng else "constant (pipeline)")
    return (f"| {d['name']} | {_ms(d['measured'])} | {_ms(d['before'])} | {d['ratio_before']:.2f} | {how} | "
            f"{_ms(d['after'])} | {d['ratio_after']:.2f} | {d['seconds']:.0f} s |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--only", default=None)
    a = ap.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"load {os.getloadavg()[0]:.2f}")
    print("| row | measured step | before | ratio | GEMMs + non-GEMM | after | ratio | dry run |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in ROWS:
        if a.only is None or a.only in row[0]:
            print(markdown(step_row(row)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
