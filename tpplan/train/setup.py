"""Everything checked before ``init_process_group``, so a mistake fails every rank together.

Every rank parses the same plan, reads the same corpus and looks at the same checkpoint
folder; each finds the same mistake and exits non-zero before any collective could hang.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from .. import checkpoint as ckpt
from ..api import Plan, load
from ..models import build_model
from ..models.introspect import vocab_size
from ..parallel.mesh import ParallelDims
from ..plan import ErrorList, PlanErrors, StepShape
from .data import Corpus, load_corpus

__all__ = ["Prepared", "TrainError", "prepare"]


class TrainError(Exception):
    """A mistake outside the plan file (command line, run folder, checkpoint)."""


@dataclass
class Prepared:
    plan: Plan  # its sections: plan.train, plan.data, plan.checkpoint, plan.metrics
    dims: ParallelDims
    step: StepShape  # micro-batch and accumulation per data-parallel rank
    model: nn.Module  # on the meta device, not yet parallelized
    corpus: Corpus
    run_dir: Path
    ckpt_dir: Path
    resume_from: Path | None


def _resume_path(resume: str | None, ckpt_dir: Path) -> Path | None:
    if resume is None:
        return None
    if resume == "latest":
        return ckpt.latest(ckpt_dir)  # None: nothing saved yet, start fresh
    found = ckpt.find_checkpoint(Path(resume))
    if found is None:
        raise TrainError(f"--resume {resume}: not a complete checkpoint, and no complete "
                         f"checkpoint (step-N/ with .metadata and {ckpt.TRAINER_FILE}) inside")
    return found


def _check_same_model(path: Path, model: nn.Module) -> None:
    saved = ckpt.read_trainer_state(path).get("model_shapes", {})
    now = ckpt.model_shapes(model)
    if saved == now:
        return
    diff = [n for n in sorted(saved.keys() | now.keys()) if saved.get(n) != now.get(n)]
    shown = ", ".join(f"{n}: saved {saved.get(n)} vs now {now.get(n)}" for n in diff[:4])
    raise TrainError(f"checkpoint {path} is from a different model ({len(diff)} parameters "
                     f"differ: {shown}{' ...' if len(diff) > 4 else ''})")


def prepare(plan_path: str, overrides: Sequence[str], resume: str | None,
            overwrite: bool) -> Prepared:
    """Parse and check everything a run needs; raise PlanErrors / TrainError on a mistake."""
    plan = load(plan_path, overrides)  # every section, the trainer's included
    world = int(os.environ.get("WORLD_SIZE", "1"))
    t, data = plan.train, plan.data
    errs = ErrorList()
    where = data.locs.get("path", data.loc)
    if data.path is not None and not Path(data.path).exists():
        errs.add(f"data.path '{data.path}' does not exist (a text file, a folder of text files, "
                 f"or a .bin of uint16 tokens; null = the Python standard library)", where)
    try:  # reported together with the data path: every mistake at once
        dims = plan.parallel_dims(world)
        step = plan.step_shape(world)  # the batch against the mesh, seq_len under SP
    except PlanErrors as e:
        errs.extend(e.errors)
    errs.raise_if_any()
    model = build_model(plan.model, device="meta", real_buffers=True)
    plan.check(model, world)  # patterns, divisibility: located errors
    max_len = getattr(getattr(model, "config", None), "max_seq_len", None)
    if max_len is not None and t.seq_len > max_len:
        errs.add(f"train.seq_len={t.seq_len} exceeds the model's max_seq_len={max_len}",
                 t.locs.get("seq_len", t.loc))
    errs.raise_if_any()
    corpus = load_corpus(data.path, data.max_bytes)
    vocab = vocab_size(model)
    if vocab is not None and corpus.vocab_size > vocab:
        errs.add(f"the data has tokens up to {corpus.vocab_size - 1} but the model's vocabulary "
                 f"is {vocab}", where)
    if len(corpus) < t.seq_len + 2:
        errs.add(f"the data has {len(corpus)} tokens, fewer than one sequence of "
                 f"{t.seq_len} + 1", where)
    errs.raise_if_any()
    run_dir = Path(plan.metrics.run_dir or Path("runs") / Path(plan_path).stem)
    ckpt_dir = Path(plan.checkpoint.dir) if plan.checkpoint.dir else run_dir / "checkpoints"
    resume_from = _resume_path(resume, ckpt_dir)
    if resume_from is not None:
        _check_same_model(resume_from, model)
    elif resume is None and not overwrite and ckpt.latest(ckpt_dir) is not None:
        raise TrainError(f"{ckpt_dir} already holds checkpoints of an earlier run: pass --resume "
                         f"to continue it, --overwrite to start over, or "
                         f"--set metrics.run_dir=<new folder>")
    return Prepared(plan, dims, step, model, corpus, run_dir, ckpt_dir, resume_from)
