"""Test hooks, each switched on by one environment variable and off by default.

They make real failures happen at a chosen moment -- a worker killed by SIGKILL, a step slow
enough to be interrupted, a record of every batch -- so tests can assert what a user sees.
Nothing here is simulated: the kill is a real ``SIGKILL`` of the real process.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from pathlib import Path

import torch

__all__ = ["KILL_AT_ENV", "RECORD_BATCHES_ENV", "SLOW_STEP_ENV", "after_step", "batch_recorder"]

RECORD_BATCHES_ENV = "TPPLAN_RECORD_BATCHES"  # "1": each rank logs a digest per batch
KILL_AT_ENV = "TPPLAN_TEST_KILL_AT"  # "RANK:STEP": SIGKILL that rank after that step, once
SLOW_STEP_ENV = "TPPLAN_TEST_STEP_SLEEP_S"  # seconds every step sleeps at its end


def after_step(rank: int, step: int) -> None:
    pause = os.environ.get(SLOW_STEP_ENV)
    if pause:
        time.sleep(float(pause))
    kill = os.environ.get(KILL_AT_ENV)
    # Only in the first round of a launch: the restarted workers must run on.
    if kill == f"{rank}:{step}" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        os.kill(os.getpid(), signal.SIGKILL)


def batch_recorder(run_dir: Path, rank: int, dp_rank: int, tp_rank: int):
    if os.environ.get(RECORD_BATCHES_ENV) != "1":
        return lambda step, batch: None
    folder = run_dir / "batches"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank{rank}.jsonl"

    def record(step: int, batch: torch.Tensor) -> None:
        digest = hashlib.sha256(batch.numpy().tobytes()).hexdigest()[:16]
        with open(path, "a") as out:
            out.write(json.dumps({"step": step, "dp_rank": dp_rank, "tp_rank": tp_rank,
                                  "digest": digest}) + "\n")
    return record
