"""Steps and wall time lost per fault: fault tolerance (torchft replica groups) against
torchrun's ``--max-restarts`` on the same run.

Four runs of the debug Llama (``plans/llama.yaml``, FSDP 2 inside each replica, 2 replicas,
4 CPU processes on gloo), every step slowed by the same sleep (``--step-sleep``, standing in
for a longer step), one rank of the second replica SIGKILLed after step ``--kill-at`` by the
test hook of ``tests/hooked.py`` (a real SIGKILL):

- ``ft``: ``fault_tolerance.replica_groups=2``, ``--nproc 2 --max-restarts 1``, without and
  with the kill; the survivor goes on, the killed group restarts and recovers from it;
- ``restart``: ``mesh.dp_replicate=2``, ``--nproc 4 --max-restarts 1``, without and with the
  kill; every rank restarts and resumes from the last checkpoint (``checkpoint.interval``).

Per fault: steps lost (steps trained again: for ``restart`` those since the checkpoint; for
``ft`` the step the survivor ran again without the dead group), the global batch's sequences
not trained (``ft``: the dead group's share while it was away), and wall time lost (the run
with the kill minus the run without).

    OMP_NUM_THREADS=1 python scripts/bench_ft.py [--steps 40] [--kill-at 12] [--step-sleep 0.5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOOKED = ROOT / "tests" / "hooked.py"
TINY = ["model.kwargs.n_layers=2", "model.kwargs.dim=64", "train.seq_len=32", "train.global_batch_size=4",
        "train.micro_batch_size=1", "train.lr=0.003", "train.warmup_steps=2", "data.max_bytes=200000",
        "mesh.tp=1"]


def _machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() \
        else platform.processor()
    return f"{model}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}"


def _run(run_dir: Path, sets: list[str], nproc: int, kill: str | None, args) -> tuple[float, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TPPLAN_TEST_STEP_SLEEP_S=str(args.step_sleep))
    if kill:
        env["TPPLAN_TEST_KILL_AT"] = kill
    cmd = [sys.executable, str(HOOKED), "train", "--plan", str(ROOT / "plans" / "llama.yaml"),
           "--nproc", str(nproc), "--max-restarts", "1"]
    for s in [*TINY, f"train.steps={args.steps}", f"checkpoint.interval={args.interval}",
              f"metrics.run_dir={run_dir}", *sets]:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{run_dir.name}: exit {proc.returncode}\n{(proc.stdout + proc.stderr)[-3000:]}")
    return wall, proc.stdout + proc.stderr


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kill-at", type=int, default=12)
    p.add_argument("--interval", type=int, default=10, help="checkpoint.interval of both")
    p.add_argument("--step-sleep", type=float, default=0.5)
    args = p.parse_args()
    print(f"machine: {_machine()}")
    kill = f"3:{args.kill_at}"  # global rank 3: the second replica's rank 1
    ft_sets = ["fault_tolerance.replica_groups=2"]
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        ft_clean, _ = _run(d / "ft-clean", ft_sets, 2, None, args)
        ft_fault, _ = _run(d / "ft-fault", ft_sets, 2, kill, args)
        rs_clean, _ = _run(d / "restart-clean", ["mesh.dp_replicate=2"], 4, None, args)
        rs_fault, out = _run(d / "restart-fault", ["mesh.dp_replicate=2"], 4, kill, args)
        rows = _rows(d / "ft-fault" / "metrics.jsonl")
        away = [r for r in rows if r.get("replicas", 2) < 2]
        full = rows[0]["tokens_trained"]
        untrained = sum(full - r["tokens_trained"] for r in away)
        # the survivor's own stall: quorums, recovery and the failed try, beyond a clean run's
        stalled = sum(r["quorum_s"] for r in rows) - sum(r["quorum_s"] for r in _rows(d / "ft-clean" / "metrics.jsonl"))
        resumed = args.kill_at // args.interval * args.interval
    print(f"{args.steps} steps, kill after step {args.kill_at}, checkpoints every {args.interval}, "
          f"each step slowed by {args.step_sleep} s")
    print("| | steps trained again | targets of the global batch not trained | wall, no fault | "
          "wall, one fault | wall time lost | the survivors' stall |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print(f"| ft (2 replica groups × 2) | 0 (step {args.kill_at + 1}'s first try not committed, run "
          f"again without the dead group) | "
          f"{untrained} ({len(away)} steps at 1 of 2 groups) | {ft_clean:.1f} s | {ft_fault:.1f} s | "
          f"{ft_fault - ft_clean:.1f} s | {stalled:.1f} s |")
    print(f"| --max-restarts (4 ranks) | {args.kill_at - resumed} (steps {resumed + 1}..{args.kill_at}) | 0 | "
          f"{rs_clean:.1f} s | {rs_fault:.1f} s | {rs_fault - rs_clean:.1f} s | every rank restarts |")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    assert "restarted by torchrun" in out


if __name__ == "__main__":
    main()
