"""Running ``tpplan train`` on the tiny Llama the training tests share, and reading its run.

The tiny config trains in seconds yet keeps all four plan features (TP, SP, loss parallel,
FSDP2) active; every curve is compared with a single-process run of the same plan made in
the same test session (the ``reference_run`` fixture), never with stored numbers.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from helpers import PLANS, start_cli, tpplan_cli

PLAN = str(PLANS / "llama.yaml")
STEPS = 12
# Tiny but real: 2 layers, all four plan features (TP, SP, loss parallel, FSDP2) active.
TINY = ["model.kwargs.n_layers=2", "model.kwargs.dim=64", f"train.steps={STEPS}",
        "train.seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=1",
        "train.lr=0.003", "train.warmup_steps=2", "train.grad_clip=1.0",
        "data.max_bytes=200000", "checkpoint.interval=5"]
TIMEOUT = 240
# No test run through here (or through the other files' train helpers, which add this too)
# reads the dry run rank 0 makes before the first step (its figures in the summary and
# estimate.json: tests/test_observe.py runs its own): skipped, 1.6 CPU-s a launch of 4
# processes. A test's own --set metrics.dry_run=true comes after and wins.
QUICK_START = ["metrics.dry_run=false"]


def train_args(run_dir: Path, *extra: str, nproc: int | None = None, sets=(),
               plan: str = PLAN) -> list[str]:
    args = ["train", "--plan", plan]
    for s in [*TINY, *QUICK_START, f"metrics.run_dir={run_dir}", *sets]:
        args += ["--set", s]
    if nproc:
        args += ["--nproc", str(nproc)]
    return [*args, *extra]


def tpplan_train(run_dir: Path, *extra: str, nproc: int | None = None, sets=(),
                 env: dict | None = None, timeout: int = TIMEOUT,
                 plan: str = PLAN) -> subprocess.CompletedProcess:
    return tpplan_cli(*train_args(run_dir, *extra, nproc=nproc, sets=sets, plan=plan), env=env,
                      timeout=timeout)


def start_train(run_dir: Path, *extra: str, nproc: int | None = None, sets=(),
                env: dict | None = None) -> subprocess.Popen:
    return start_cli(*train_args(run_dir, *extra, nproc=nproc, sets=sets), env=env)


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    """Until ``metrics.jsonl`` has a row of ``step`` (the run is that far and still going)."""
    deadline = time.monotonic() + timeout
    path = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the run ended early:\n{proc.stdout.read()[-3000:]}"
        if path.exists() and any(f'"step": {step},' in line
                                 for line in path.read_text().splitlines()):
            return
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"step {step} not reached in {timeout} s")


def finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    """Wait for a started run; its whole output."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return out


def ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def metrics(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows}


def assert_same_curve(got: dict[int, dict], ref: dict[int, dict], steps, rel: float = 1e-4):
    for s in steps:
        for key in ("loss", "grad_norm"):
            a, b = got[s][key], ref[s][key]
            assert abs(a - b) <= rel * abs(b), f"step {s} {key}: {a} vs reference {b}"


def fails(proc: subprocess.CompletedProcess, *needles: str) -> str:
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-2000:]
    for n in needles:
        assert n in out, out[-2000:]
    assert "Traceback" not in out, out[-3000:]
    return out
