"""What the tests share: where the project is, and running the ``tpplan`` command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLANS = ROOT / "plans"
TEST_PLANS = ROOT / "tests" / "plans"


def cli_env(env: dict | None = None) -> dict:
    """The environment a user's shell gives ``tpplan``: CPU, one thread per rank."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TPPLAN_DEVICE": "cpu",
                "PYTHONPATH": str(ROOT), **(env or {})}
    for key in ("RANK", "TORCHELASTIC_RUN_ID"):  # a test under torchrun must not look like a rank
        full_env.pop(key, None)
    return full_env


def tpplan_command(env: dict | None = None) -> list[str]:
    """What runs ``tpplan`` after the interpreter: ``-m tpplan``, or tests/hooked.py (the same
    command with test hooks installed) when ``env`` switches one of its hooks on."""
    from hooked import HERE, HOOKS

    return [str(HERE)] if any(name in (env or {}) for name in HOOKS) else ["-m", "tpplan"]


def start_cli(*args, env: dict | None = None, **popen) -> subprocess.Popen:
    """``python -m tpplan ARGS`` started in the background (stdout and stderr together);
    through tests/hooked.py when ``env`` switches a test hook on (:func:`tpplan_command`)."""
    return subprocess.Popen([sys.executable, *tpplan_command(env), *map(str, args)], cwd=ROOT,
                            env=cli_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, **popen)


def tpplan_cli(*args, cwd=None, env: dict | None = None, timeout: int = 300,
               check: bool = False) -> subprocess.CompletedProcess:
    """``python -m tpplan ARGS`` in a fresh process, as a user runs it (CPU, one thread per
    rank; through tests/hooked.py when ``env`` switches a test hook on); ``check`` asserts
    exit 0 and shows the output's tail when it is not."""
    proc = subprocess.run([sys.executable, *tpplan_command(env), *map(str, args)], cwd=cwd or ROOT,
                          env=cli_env(env), capture_output=True, text=True, timeout=timeout)
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
