"""Time and peak memory of ``tpplan validate`` (the whole command, in a fresh process).

Each run is a child process; wall time is measured around it, CPU time and peak memory
are the child's own (``os.wait4`` rusage: user + system seconds, maximum resident set
size), so nothing of this script counts. The command is single-threaded, so on an idle
machine wall ≈ CPU; on a shared one CPU time is the figure that does not depend on load.

    python scripts/bench_validate.py                 # the table in docs/benchmarks.md
    python scripts/bench_validate.py --only-target   # 405b at 4,096 ranks, tp 2 and tp 8, only
    python scripts/bench_validate.py --only-target --baseline /path/to/other/checkout

Each row sizes the step at 8 sequences per data-parallel rank (the global batch is set to
8 × dp, as a run at that size would). ``--baseline`` runs every row a second time with the
other checkout's tpplan and plan, alternating which goes first, and adds the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from checkout import command

ROOT = Path(__file__).resolve().parent.parent
PLAN = ROOT / "plans" / "llama.yaml"
# Issue 27's target: 405B on 4,096 ranks at tp 2 and at tp 8, each in at most 5 s.
TARGETS = (("405b", 4096, 2), ("405b", 4096, 8))
TARGET_SECONDS = 5.0


def measure(config: str, layers: int | None, world: int, tp: int, root: Path = ROOT) -> dict:
    """One ``tpplan validate --json`` run of the tpplan at ``root``: seconds, peak RSS (MiB)
    and the verdict."""
    cmd = command(root, "-m", "tpplan", "validate", "--plan", root / PLAN.relative_to(ROOT),
                  "--world-size", world, "--json", "--set", f"model.config={config}",
                  "--set", f"mesh.tp={tp}", "--set", f"train.global_batch_size={8 * world // tp}")
    if layers is not None:
        cmd += ["--set", f"model.kwargs.n_layers={layers}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    data = json.loads(out) if out else {}
    return dict(config=config, layers=layers, world=world, tp=tp, seconds=wall,
                cpu=usage.ru_utime + usage.ru_stime,
                peak_mib=usage.ru_maxrss / 1024, ok=data.get("ok", False) and status == 0,
                total_gib=(data.get("memory_per_rank", {}).get("total") or 0) / 2**30)


def row(r: dict) -> str:
    return (f"| {r['config']} | {r['layers'] or 'all'} | {r['world']:,} | {r['tp']} | "
            f"{r['seconds']:.1f} | {r['cpu']:.1f} | {r['peak_mib']:.0f} | "
            f"{'yes' if r['ok'] else 'NO'} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--only-target", action="store_true")
    p.add_argument("--repeat", type=int, default=3,
                   help="runs of the target row; its median is the verdict (run-to-run spread "
                        "on a shared 2-core machine is a few seconds)")
    p.add_argument("--baseline", type=Path, help="another checkout of tpplan to compare with")
    args = p.parse_args()
    print(f"machine: {os.cpu_count()} CPUs visible, load average {os.getloadavg()[0]:.1f} at "
          f"start; python {sys.version.split()[0]}")
    print("| config | layers | world size | tp | wall (s) | CPU (s) | peak RSS (MiB) | valid |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    runs = [(config, None, world, tp) for config, world, tp in TARGETS for _ in range(args.repeat)]
    if not args.only_target:
        runs += [("405b", n, 4096, 8) for n in (8, 32, 63)]
        runs += [("405b", None, w, 8) for w in (64, 512)]
        runs += [("70b", None, 1024, 8), ("8b", None, 64, 8)]
    targets, ratios = [], []
    for i, (config, layers, world, tp) in enumerate(runs):
        if args.baseline and i % 2:  # alternate which tree goes first
            base = measure(config, layers, world, tp, args.baseline)
        r = measure(config, layers, world, tp)
        if args.baseline and not i % 2:
            base = measure(config, layers, world, tp, args.baseline)
        print(row(r), flush=True)
        if args.baseline:
            ratios.append(r["seconds"] / base["seconds"])
            print(f"|   baseline | | | | {base['seconds']:.1f} | {base['cpu']:.1f} | "
                  f"{base['peak_mib']:.0f} | ratio {ratios[-1]:.3f}x |", flush=True)
        if (config, world, tp) in TARGETS and layers is None:
            targets.append(r)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    if ratios:
        print(f"this tree / baseline, wall time: median {sorted(ratios)[len(ratios) // 2]:.3f}x "
              f"over {len(ratios)} rows")
    ok = True
    for config, world, tp in TARGETS:
        runs_at = sorted((r for r in targets if (r["config"], r["world"], r["tp"]) == (config, world, tp)),
                         key=lambda r: r["cpu"])
        median = runs_at[len(runs_at) // 2]
        met = all(r["ok"] for r in runs_at) and median["cpu"] <= TARGET_SECONDS and \
            max(r["peak_mib"] for r in runs_at) <= 2048
        ok = ok and met
        # CPU time is the verdict: the command is single-threaded, so on an idle machine it is
        # the wall time, and on a shared one it does not count the other processes' turns.
        print(f"target ({config}, {world:,} ranks, tp {tp}), median of {len(runs_at)}: "
              f"{median['seconds']:.1f} s wall, {median['cpu']:.1f} s CPU, "
              f"{max(r['peak_mib'] for r in runs_at):.0f} MiB peak "
              f"-> {'met' if met else 'NOT met'} (≤ {TARGET_SECONDS:g} s CPU, ≤ 2 GiB)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
