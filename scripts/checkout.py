"""Run Python against one checkout of tpplan: the benchmarks' ``--baseline`` side.

An editable install (``pip install -e .``) puts a finder ahead of ``sys.path`` that always
answers ``import tpplan`` with the installed tree, so ``PYTHONPATH=/other/checkout`` alone
would silently benchmark the same code twice. :func:`command` drops that finder in the
child and puts ``root`` first, and the child checks which tree it imported.
"""

from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["command"]

_BOOT = """
import os, runpy, sys
root = sys.argv[1]
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path.insert(0, root)
import tpplan
assert tpplan.__file__.startswith(root), (tpplan.__file__, root)
sys.argv = sys.argv[2:]
if sys.argv[0] == "-m":
    sys.argv = sys.argv[1:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:  # as `python script.py` does: the script's folder first on the path
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
    runpy.run_path(sys.argv[0], run_name="__main__")
"""


def command(root: Path, *args: str) -> list[str]:
    """argv that runs ``python ARGS`` (a script path, or ``-m module ...``) with the tpplan
    of checkout ``root``."""
    return [sys.executable, "-c", _BOOT, str(Path(root).resolve()), *map(str, args)]
