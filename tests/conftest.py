import os
import sys
from pathlib import Path

import pytest

# Multi-process tests share two cores: one thread per rank keeps them from thrashing.
os.environ.setdefault("OMP_NUM_THREADS", "1")

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))  # toy_models for factory plans, also in spawned ranks

from helpers import ROOT  # noqa: E402


@pytest.fixture
def root() -> Path:
    return ROOT


@pytest.fixture
def write_plan(tmp_path):
    """Write a plan file and return its path; ``name`` lets plans extend each other."""

    def write(text: str, name: str = "plan.yaml") -> str:
        path = tmp_path / name
        path.write_text(text)
        return str(path)

    return write


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory) -> Path:
    """``tpplan train`` of the tiny Llama in one process, no parallelism: the curve every
    mesh shape, restart and resume must reproduce (tests/trainrun.py)."""
    from trainrun import ok, tpplan_train

    d = tmp_path_factory.mktemp("reference") / "single"
    ok(tpplan_train(d, sets=["mesh.tp=1"]))
    return d
