"""One replica group's torchrun: ``python -m tpplan.ft.torchrun ARGS`` is ``torchrun ARGS``,
with its end said by its exit code instead of a traceback: a stop by a signal (the launcher
passes a SIGTERM on; the workers had their grace to save) exits 128 + the signal, a group
out of restarts exits 1 (its failing rank already printed why, as ``error: ...``)."""

from __future__ import annotations

import sys

__all__ = ["main"]


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
    except SignalException as e:
        return 128 + int(e.sigval)
    except ChildFailedError:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
