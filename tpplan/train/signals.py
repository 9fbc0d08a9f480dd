"""Preemption: SIGTERM (what SLURM and Kubernetes send before a kill) or SIGINT stops the run
at the end of the current step, with a checkpoint, on every rank together.

The handler only records the signal. After each step the ranks agree (one all-reduce of the
signal number, MAX), so a signal that reached one rank stops them all at the same step; the
trainer then saves and exits with :data:`EXIT_STOPPED`. A second signal aborts at once --
except one arriving within :data:`REPEAT_WINDOW_S` of the first: schedulers signal every
process of a job and torchrun forwards its own copy to its workers, so one preemption can
arrive twice in the same instant.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

__all__ = ["EXIT_STOPPED", "Preemption"]

EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped early, checkpoint saved; run again with --resume
REPEAT_WINDOW_S = 2.0
HANDLED = (signal.SIGTERM, signal.SIGINT)


class Preemption:
    """Install with ``with Preemption() as stop:``; ``stop.agreed(device)`` after each step
    returns the signal number every rank agrees on (0: carry on)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.signum = 0
        self.first_at = 0.0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> Preemption:
        if self.enabled:
            for s in HANDLED:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        if not self.signum:
            self.signum, self.first_at = signum, now
            return
        if now - self.first_at < REPEAT_WINDOW_S:
            return  # the same preemption, delivered by the scheduler and by torchrun
        if os.environ.get("RANK", "0") == "0":
            print(f"tpplan train: second {signal.Signals(signum).name}: aborting now, without "
                  f"a checkpoint", file=sys.stderr, flush=True)
        os._exit(128 + signum)

    def agreed(self, device: torch.device) -> int:
        flag = torch.tensor([self.signum], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    @staticmethod
    def name(signum: int) -> str:
        return signal.Signals(signum).name
