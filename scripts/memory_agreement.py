"""The dry run's memory against real gloo steps, as the tables in docs/dry-run.md and
docs/benchmarks.md.

    OMP_NUM_THREADS=1 python scripts/memory_agreement.py > /tmp/table.md
    OMP_NUM_THREADS=1 python scripts/memory_agreement.py --1b

Runs every case of tests/memory_measure.py (the cases tests/test_dry_run_vs_real.py
asserts on): the dry run's prediction, then the plan's step for real on 4 gloo CPU
processes, measured; prints predicted, measured and their ratio per part. ~3 minutes.
``--1b``: the Llama 3.2 1B shape cut to 1 block (``CASES_1B``), a full fine-tune against
LoRA rank 16: the peak ratio of the two, measured and predicted (~18 GiB of memory over the
4 processes), then one step of ``tpplan train`` of each with a checkpoint, its bytes on
disk against the dry run's ``checkpoint_bytes``. A few minutes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from memory_measure import CASES, CASES_1B, compare, measure_worker  # noqa: E402

from tpplan.analysis import ANALYSES  # noqa: E402
from tpplan.analysis.dryrun import dry_run  # noqa: E402
from tpplan.parallel.runtime import spawn  # noqa: E402

MEMORY = [a for a in ANALYSES if a[0] == "memory_per_rank"]


def main(argv: list[str]) -> int:
    cases = CASES_1B if "--1b" in argv else CASES
    peaks = {}
    print("| case | part | predicted | measured | ratio |")
    print("|---|---|---:|---:|---:|")
    for name, (plan, world, overrides) in cases.items():
        predicted = dry_run(str(ROOT / "plans" / plan), world, overrides, MEMORY)
        assert predicted.ok, (predicted.errors, predicted.analysis_errors)
        with tempfile.TemporaryDirectory() as tmp:
            spawn(measure_worker, world, str(ROOT / "plans" / plan), overrides, tmp)
            measured = json.loads((Path(tmp) / "measured.json").read_text())
        for row in compare(predicted.extra["memory_per_rank"], measured):
            print(f"| {name} | {row['part']} | {row['predicted']:,} | {row['measured']:,} | "
                  f"{row['ratio']:.3f} |", flush=True)
            if row["part"] == "peak":
                peaks[name] = row
    if len(peaks) == 2:  # --1b: the second case (LoRA) against the first (full)
        full, lora = peaks.values()
        print(f"\npeak LoRA / full: measured {lora['measured'] / full['measured']:.3f}, "
              f"dry run {lora['predicted'] / full['predicted']:.3f}")
        checkpoint_sizes(cases)
    return 0


def checkpoint_sizes(cases: dict) -> None:
    """One step of ``tpplan train`` per case (4 CPU processes), checkpointed: the step
    folder's bytes on disk against the dry run's figure."""
    print("\n| case | checkpoint on disk | dry run | ratio |")
    print("|---|---:|---:|---:|")
    sizes = []
    for name, (plan, world, overrides) in cases.items():
        with tempfile.TemporaryDirectory() as tmp:
            sets = [*overrides, "train.steps=1", "checkpoint={interval: 1, keep: 1}",
                    "data.max_bytes=200000", "eval=null", f"metrics.run_dir={tmp}/run"]
            predicted = dry_run(str(ROOT / "plans" / plan), world, sets).checkpoint_bytes
            subprocess.run([sys.executable, "-m", "tpplan", "train", "--plan",
                            str(ROOT / "plans" / plan), "--nproc", str(world),
                            *[a for s in sets for a in ("--set", s)]],
                           check=True, capture_output=True)
            [step] = (Path(tmp) / "run" / "checkpoints").glob("step-*")
            on_disk = sum(f.stat().st_size for f in step.rglob("*") if f.is_file())
        sizes.append(on_disk)
        print(f"| {name} | {on_disk:,} | {predicted:,} | {predicted / on_disk:.3f} |", flush=True)
    print(f"\ncheckpoint LoRA / full: {sizes[1] / sizes[0]:.5f}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
