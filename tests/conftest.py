import fcntl
import os
import shutil
import sys
from pathlib import Path

import pytest

# Multi-process tests share two cores: one thread per rank keeps them from thrashing.
os.environ.setdefault("OMP_NUM_THREADS", "1")

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))  # toy_models for factory plans, also in spawned ranks

from helpers import ROOT  # noqa: E402

# transformers' model base imported here, before any test asks for ranks: the ranks' server,
# started at the first tpplan.parallel.runtime.spawn of this process, then has it too, and a
# HuggingFace model's ranks do not each import it (about 2 CPU-s apiece).
try:
    import transformers.modeling_utils  # noqa: E402, F401
except ImportError:  # the hf extra not installed: those tests skip
    pass


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


def _made_once(tmp_path_factory, name: str, make) -> Path:
    """``make(folder)`` run once per session, also across pytest-xdist's workers: the first
    worker to get here makes it in the session's shared temporary folder under a file lock,
    the others wait for it and reuse it (what it makes is only read afterwards)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest-N/, above every worker's popen-gwK/
    out = root / f"shared-{name}"
    with open(root / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / ".made").exists():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            make(out)
            (out / ".made").touch()
    return out


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory) -> Path:
    """``tpplan train`` of the tiny Llama in one process, no parallelism: the curve every
    mesh shape, restart and resume must reproduce (tests/trainrun.py)."""
    from trainrun import ok, tpplan_train

    return _made_once(tmp_path_factory, "reference",
                      lambda out: ok(tpplan_train(out / "single", sets=["mesh.tp=1"]))) / "single"


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """``tiny_hf("llama")`` / ``tiny_hf("qwen2", dtype="bfloat16")``: a HF model folder made by
    scripts/make_tiny_hf.py (weights, tokenizer, chat.jsonl), once per session per kind."""
    import subprocess

    from helpers import cli_env

    made: dict[tuple, Path] = {}

    def make(family: str = "llama", dtype: str = "float32") -> Path:
        key = (family, dtype)
        if key not in made:
            made[key] = _made_once(tmp_path_factory, f"tiny-{family}-{dtype}", lambda out: subprocess.run(
                [sys.executable, str(ROOT / "scripts" / "make_tiny_hf.py"), "--family", family,
                 "--dtype", dtype, "--out", str(out)], check=True, capture_output=True, env=cli_env()))
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(tiny_hf) -> Path:
    """``scripts/make_tiny_hf.py --family llama``: config, weights, tokenizer with a chat
    template marking assistant turns, chat.jsonl and chat-eval.jsonl (once per session)."""
    return tiny_hf("llama")
