"""Two seams in the training loop: functions the loop calls that do nothing here.

A script that wraps the ``tpplan`` command may replace either for its process (the loop
looks both up on this module at each run, so setting the attribute is enough); under
torchrun its workers run that script too when it names itself in
:data:`tpplan.commands.train.WORKER_COMMAND`. tests/hooked.py does this to kill a rank
after a chosen step, slow every step, or record each rank's batches, so the tests can
assert what a user sees of a real failure. A run of ``tpplan train`` leaves both as they are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

__all__ = ["after_step", "batch_recorder"]


def after_step(rank: int, step: int) -> None:
    """Called on every rank at the end of each step: after its metrics row is logged, before
    the ranks agree on a stop signal and before the step's checkpoint (if any) is saved."""


def _ignore(step: int, batch: torch.Tensor) -> None:
    return None


def batch_recorder(run_dir: Path, rank: int, dp_rank: int,
                   tp_rank: int) -> Callable[[int, torch.Tensor], None]:
    """What the loop calls with each step's number and this rank's tokens, made once per run
    with where the run writes and this rank's place in the mesh. Records nothing."""
    return _ignore
