"""What the tests share: where the project is, and running the ``tpplan`` command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLANS = ROOT / "plans"
TEST_PLANS = ROOT / "tests" / "plans"


def tpplan_cli(*args, cwd=None, env: dict | None = None, timeout: int = 300,
               check: bool = False) -> subprocess.CompletedProcess:
    """``python -m tpplan ARGS`` in a fresh process, as a user runs it (CPU, one thread per
    rank); ``check`` asserts exit 0 and shows the output's tail when it is not."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TPPLAN_DEVICE": "cpu",
                "PYTHONPATH": str(ROOT), **(env or {})}
    full_env.pop("RANK", None)  # a test under torchrun must not look like a rank
    proc = subprocess.run([sys.executable, "-m", "tpplan", *map(str, args)], cwd=cwd or ROOT,
                          env=full_env, capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def run_main(capsys, *args) -> tuple[int, str]:
    """``tpplan ARGS`` in this process: its exit code and everything it printed. An exception
    escaping ``main`` fails the test, as the traceback would reach a user."""
    from tpplan.cli import main

    rc = main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out + out.err
