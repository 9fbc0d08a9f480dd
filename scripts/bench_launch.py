"""What ``tpplan train --nproc N`` costs to start, three ways side by side: workers forked
from the launcher itself (a CPU run's way), forked from a server that imported torch once (a
GPU run's way), and each worker a new interpreter (torchrun's command line).

    python scripts/bench_launch.py [--nproc 4] [--rounds 2]

Each round runs the same tiny 4-step plan both ways, alternating, and prints wall seconds
and the CPU seconds the whole machine spent meanwhile (``/proc/stat``: run it on a quiet
machine; the load average at the start is printed beside the figures). The other two ways
are this launcher with one thing turned: the server's way with the run not known to be on
the CPU, the command line's with the fork off (``run_forked`` answering "no forkserver"), so
the three differ in nothing else.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.kwargs.n_layers=2", "model.kwargs.dim=64", "train.steps=4", "train.seq_len=32",
        "train.global_batch_size=4", "train.micro_batch_size=1", "data.max_bytes=200000",
        "checkpoint.interval=0"]
# The launcher with one thing turned: the same code path otherwise.
TURNED = ("import sys, tpplan._torch.launch as launch, tpplan.commands.train as train\n"
          "{turn}\n"
          "from tpplan.cli import main\n"
          "sys.exit(main(sys.argv[1:]))\n")
WAYS = {"from the launcher": None,
        "from a server": "train._workers_on_cpu = lambda device: False",
        "new interpreters": "launch.run_forked = lambda *args, **kw: False"}

def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    return f"{cpu}, {os.cpu_count()} cores, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"


def busy_seconds() -> float:
    """CPU seconds the whole machine has spent (user + nice + system), from /proc/stat."""
    fields = open("/proc/stat").readline().split()[1:]
    return (int(fields[0]) + int(fields[1]) + int(fields[2])) / os.sysconf("SC_CLK_TCK")


def launch(turn: str | None, nproc: int, run_dir: Path) -> tuple[float, float]:
    args = ["train", "--plan", str(ROOT / "plans" / "llama.yaml"), "--nproc", str(nproc),
            "--overwrite"]
    for s in [*TINY, f"metrics.run_dir={run_dir}"]:
        args += ["--set", s]
    cmd = [sys.executable, *(["-c", TURNED.format(turn=turn)] if turn else ["-m", "tpplan"]), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", TPPLAN_DEVICE="cpu")
    cpu, wall = busy_seconds(), time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"the launch failed:\n{done.stderr[-2000:]}")
    return time.perf_counter() - wall, busy_seconds() - cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    print(f"machine: {machine()}")
    rows: dict[str, list[tuple[float, float]]] = {name: [] for name in WAYS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for i, (name, turn) in enumerate(WAYS.items()):
                rows[name].append(launch(turn, a.nproc, Path(tmp) / f"{i}-{r}"))
    print(f"tpplan train --nproc {a.nproc}, 4 tiny steps, {a.rounds} rounds (best of each)")
    best = {name: (min(w for w, _ in got), min(c for _, c in got)) for name, got in rows.items()}
    for name, (wall, cpu) in best.items():
        print(f"  {name:17s} wall {wall:6.1f} s   machine CPU {cpu:6.1f} s")
    base = best["new interpreters"]
    for name in ("from the launcher", "from a server"):
        print(f"  {name} / new interpreters: wall {best[name][0] / base[0]:.2f}, CPU {best[name][1] / base[1]:.2f}")

if __name__ == "__main__":
    main()
