"""torchrun's command line, as each torch version takes it.

Checked on torch 2.11 through 2.14.1. ``--shutdown-timeout`` (how long workers have to
finish after a signal before they are killed) is in torchrun from 2.13; torch 2.11's
torchrun does not know it and would exit on it.
"""

from __future__ import annotations

__all__ = ["shutdown_timeout_args"]


def shutdown_timeout_args(seconds: int) -> list[str]:
    """``["--shutdown-timeout=<seconds>"]`` where this torch's torchrun takes it, else ``[]``
    (torch 2.11: its workers get torchrun's own grace period after a signal)."""
    from torch.distributed.run import get_args_parser

    known = {s for a in get_args_parser()._actions for s in a.option_strings}
    return [f"--shutdown-timeout={seconds}"] if "--shutdown-timeout" in known else []
