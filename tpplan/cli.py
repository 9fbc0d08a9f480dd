"""``tpplan`` command line: one subcommand per module in :mod:`tpplan.commands`.

A mistake in a plan prints ``file:line:col: error: message`` lines and exits 1, never a
Python traceback; so does any other mistake in what a command was given (a path that
cannot be read or written, a checkpoint that does not load): one ``error:`` line, exit 1.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Sequence

from . import __version__
from .commands._common import print_errors
from .plan.errors import CommandError, PlanError, PlanErrors

__all__ = ["main"]

COMMANDS = ("validate", "search", "verify", "train", "report", "suggest", "import-hf", "export",
            "generate", "lighthouse", "data")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tpplan", description="Tensor-parallel training from a "
                                "YAML parallel plan.")
    p.add_argument("--version", action="version", version=f"tpplan {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"tpplan.commands.{name.replace('-', '_')}")
        module.register(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.command_line = argv is None  # this process is the command, not a caller's call
    args.main = main  # what a worker forked by ``train --nproc`` runs (commands don't import this)
    rank0 = os.environ.get("RANK", "0") == "0"
    try:
        return int(args.run(args) or 0)
    except (PlanErrors, PlanError) as e:
        # Under torchrun every rank finds the same mistake; one copy of it is enough.
        if rank0:
            print_errors(e.errors if isinstance(e, PlanErrors) else [e])
        return 1
    except CommandError as e:
        if rank0:
            print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a file the user named or the machine refused: no traceback for it
        what = f"{e.filename}: " if e.filename else ""
        print(f"error: {what}{e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
