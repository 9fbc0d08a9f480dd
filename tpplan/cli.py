"""``tpplan`` command line: one subcommand per module in :mod:`tpplan.commands`.

A mistake in a plan prints ``file:line:col: error: message`` lines and exits 1, never a
Python traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Sequence

from . import __version__
from .commands._common import print_errors
from .plan.errors import PlanErrors

__all__ = ["main"]

COMMANDS = ("validate", "verify", "train", "report", "suggest", "import-hf", "export")


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
    try:
        return int(args.run(args) or 0)
    except PlanErrors as e:
        # Under torchrun every rank finds the same mistake; one copy of it is enough.
        if os.environ.get("RANK", "0") == "0":
            print_errors(e)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
