"""Context parallelism's memory per rank: the dry run against real gloo steps, cp by cp.

    OMP_NUM_THREADS=1 python scripts/cp_memory.py [--seq-len 16384] [--cp 1 2 4] [--set K=V ...]

For each cp, ``plans/llama-long.yaml`` (the debug Llama, ring with load balancing) on cp
gloo CPU processes: the dry run's activations (what forward leaves for backward) and peak,
then the same step measured for real (PyTorch's FSDPMemTracker: tests/memory_measure.py),
their ratio, and each against cp 1. The figures in docs/long-context.md come from here
(~6 minutes at 16,384 tokens on one core per process).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from memory_measure import measure_worker  # noqa: E402

from tpplan.analysis import ANALYSES  # noqa: E402
from tpplan.analysis.dryrun import dry_run  # noqa: E402
from tpplan.parallel.runtime import spawn  # noqa: E402

PLAN = str(ROOT / "plans" / "llama-long.yaml")
MEMORY = [a for a in ANALYSES if a[0] == "memory_per_rank"]


def figures(cp: int, overrides: list[str]) -> dict[str, int]:
    """Predicted and measured activations and peak of one rank at ``cp`` (world = cp)."""
    sets = [f"mesh.cp={cp}", *overrides]
    predicted = dry_run(PLAN, cp, sets, MEMORY).extra["memory_per_rank"]
    with tempfile.TemporaryDirectory() as tmp:
        spawn(measure_worker, cp, PLAN, sets, tmp)
        measured = json.loads((Path(tmp) / "measured.json").read_text())
    return dict(predicted_activations=predicted["activations"], predicted_peak=predicted["peak"],
                activations=max(s["Activation"] for s in measured["end_forward"]),
                peak=measured["peak"]["Total"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--set", action="append", default=[], help="a plan override, K=V")
    args = ap.parse_args()
    overrides = [f"train.seq_len={args.seq_len}", *args.set]
    print(f"plans/llama-long.yaml {' '.join(overrides)}; bytes per rank\n")
    print("| cp | activations: dry run | measured | ratio | vs cp 1 | peak: dry run | measured "
          "| ratio | vs cp 1 |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    base = None
    for cp in args.cp:
        f = figures(cp, overrides)
        base = base or f
        print(f"| {cp} | {f['predicted_activations']:,} | {f['activations']:,} | "
              f"{f['predicted_activations'] / f['activations']:.3f} | "
              f"{f['activations'] / base['activations']:.3f} | {f['predicted_peak']:,} | "
              f"{f['peak']:,} | {f['predicted_peak'] / f['peak']:.3f} | "
              f"{f['peak'] / base['peak']:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
