"""One row of scripts/gpu_check.sh's MFU table: a `tpplan train` run against `tpplan validate
--json` of the same plan (the dry run's step time and peak), checked against targets.

    python scripts/gpu_rows.py NAME RUN_DIR VALIDATE_JSON [--skip N] [--min-mfu F]
        [--step-tolerance 0.25] [--peak-tolerance 0.05] [--loss-of OTHER_RUN --loss-within 0.01]

Prints the markdown row on stdout and every figure with its verdict on stderr; exits 1 when a
target is missed (the row is printed first, so the table keeps it). MFU and the step time are
the medians over the steps after ``--skip`` (warm-up and compilation left out); the peak is
CUDA's ``max_memory_allocated`` (estimate.json) against the dry run's. On CPU the MFU and the
step-time estimate are n/a (no preset): the row still prints, which is how it is tested.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def figures(run: str, validate: str, skip: int) -> dict:
    rows = [json.loads(line) for line in open(f"{run}/metrics.jsonl")]
    kept = rows[skip:] or rows[-1:]
    est = json.load(open(f"{run}/estimate.json"))
    v = json.load(open(validate))
    assert v["ok"], f"validate: {v.get('errors') or v.get('analysis_errors')}"
    st = v.get("step_time") or {}
    mfus = [r["mfu"] for r in kept if r.get("mfu") is not None]
    return dict(
        losses=[r["loss"] for r in rows],
        tokens_per_s=statistics.median(r["tokens_per_s_per_device"] for r in kept),
        mfu=statistics.median(mfus) if mfus else None,
        step_s=statistics.median(r["step_time_s"] for r in kept),
        step_est=st.get("step_time"), mfu_est=st.get("mfu"),
        peak=est["measured"]["peak_bytes"], peak_est=v["memory_per_rank"]["peak"],
        device=est.get("device_type"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name")
    ap.add_argument("run")
    ap.add_argument("validate")
    ap.add_argument("--skip", type=int, default=2)
    ap.add_argument("--min-mfu", type=float, default=None)
    ap.add_argument("--step-tolerance", type=float, default=0.25)
    ap.add_argument("--peak-tolerance", type=float, default=0.05)
    ap.add_argument("--loss-of", default=None, help="another run whose loss curve this one must follow")
    ap.add_argument("--loss-within", type=float, default=0.01)
    a = ap.parse_args(argv)
    f = figures(a.run, a.validate, a.skip)
    missed = []
    pct = lambda x: "n/a" if x is None else f"{x:.1%}"  # noqa: E731
    if a.min_mfu is not None and f["mfu"] is not None and f["mfu"] < a.min_mfu:
        missed.append(f"MFU {pct(f['mfu'])} below the target {pct(a.min_mfu)}")
    step_ratio = f["step_s"] / f["step_est"] if f["step_est"] else None
    if step_ratio is not None and abs(step_ratio - 1) > a.step_tolerance:
        missed.append(f"step {f['step_s']:.3f} s measured vs {f['step_est']:.3f} s estimated: "
                      f"x{step_ratio:.2f}, outside ±{a.step_tolerance:.0%}")
    peak_ratio = f["peak"] / f["peak_est"] if f["peak_est"] else None
    if f["device"] == "cuda" and peak_ratio is not None and abs(peak_ratio - 1) > a.peak_tolerance:
        missed.append(f"peak x{peak_ratio:.3f} of the dry run's, outside ±{a.peak_tolerance:.0%}")
    if a.loss_of:
        other = [json.loads(line)["loss"] for line in open(f"{a.loss_of}/metrics.jsonl")]
        worst = max(abs(x - y) / abs(y) for x, y in zip(f["losses"], other))
        if worst > a.loss_within:
            missed.append(f"loss curve off {a.loss_of}'s by {worst:.2%} (> {a.loss_within:.0%})")
    ratio = lambda x: "n/a" if x is None else f"{x:.2f}×"  # noqa: E731
    print(f"| {time.strftime('%Y-%m-%d')} | {a.name} | {f['tokens_per_s']:,.0f} | {pct(f['mfu'])} | "
          f"{pct(f['mfu_est'])} | {f['step_s'] * 1e3:.0f} ms | "
          f"{'n/a' if not f['step_est'] else format(f['step_est'] * 1e3, '.0f') + ' ms'} | {ratio(step_ratio)} | "
          f"{f['peak'] / 2**30:.2f} GiB | {f['peak_est'] / 2**30:.2f} GiB | {ratio(peak_ratio)} |")
    for m in missed:
        print(f"gpu_rows: {a.name}: target missed: {m}", file=sys.stderr)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
