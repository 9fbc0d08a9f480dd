"""The dry run's memory against real gloo steps, as the table in docs/dry-run.md.

    OMP_NUM_THREADS=1 python scripts/memory_agreement.py > /tmp/table.md

Runs every case of tests/memory_measure.py (the cases tests/test_dry_run_vs_real.py
asserts on): the dry run's prediction, then the plan's step for real on 4 gloo CPU
processes, measured; prints predicted, measured and their ratio per part. ~3 minutes.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from memory_measure import CASES, compare, measure_worker  # noqa: E402

from tpplan.analysis import ANALYSES  # noqa: E402
from tpplan.analysis.dryrun import dry_run  # noqa: E402
from tpplan.parallel.runtime import spawn  # noqa: E402

MEMORY = [a for a in ANALYSES if a[0] == "memory_per_rank"]


def main() -> int:
    print("| case | part | predicted | measured | ratio |")
    print("|---|---|---:|---:|---:|")
    for name, (plan, world, overrides) in CASES.items():
        predicted = dry_run(str(ROOT / "plans" / plan), world, overrides, MEMORY)
        with tempfile.TemporaryDirectory() as tmp:
            spawn(measure_worker, world, str(ROOT / "plans" / plan), overrides, tmp)
            measured = json.loads((Path(tmp) / "measured.json").read_text())
        for row in compare(predicted.extra["memory_per_rank"], measured):
            print(f"| {name} | {row['part']} | {row['predicted']:,} | {row['measured']:,} | "
                  f"{row['ratio']:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
