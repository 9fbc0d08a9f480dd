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

from ..errors import ErrorList
from ..parallel_dims import ParallelDims
from ..plan import Plan, load
from . import checkpoint as ckpt
from .config import RunConfig, parse_run_config
from .data import Corpus, load_corpus

__all__ = ["Prepared", "TrainError", "prepare"]


class TrainError(Exception):
    """A mistake outside the plan file (command line, run folder, checkpoint)."""


@dataclass
class Prepared:
    plan: Plan
    cfg: RunConfig
    dims: ParallelDims
    model: nn.Module  # on the meta device, not yet parallelized
    corpus: Corpus
    accum: int  # micro-batches per optimizer step on each data-parallel rank
    micro: int
    run_dir: Path
    ckpt_dir: Path
    resume_from: Path | None


def _vocab_size(model: nn.Module) -> int | None:
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "vocab_size"):
        return cfg.vocab_size
    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return emb.num_embeddings if emb is not None else None


def _batch_checks(cfg: RunConfig, dims: ParallelDims, errs: ErrorList) -> tuple[int, int]:
    t = cfg.train
    loc = t.locs.get("global_batch_size")
    micro = t.micro_batch_size or max(t.global_batch_size // dims.dp, 1)
    if t.global_batch_size % dims.dp:
        errs.add(f"train.global_batch_size={t.global_batch_size} is not divisible by the "
                 f"data-parallel size {dims.dp} ({dims}); each data-parallel rank needs the "
                 f"same number of sequences", loc)
        return 1, micro
    per_rank = t.global_batch_size // dims.dp
    if per_rank % micro:
        errs.add(f"train.global_batch_size={t.global_batch_size} over dp={dims.dp} is "
                 f"{per_rank} sequences per rank, not a multiple of train.micro_batch_size="
                 f"{micro} (gradient accumulation needs whole micro-batches)",
                 t.locs.get("micro_batch_size", loc))
    return max(per_rank // micro, 1), micro


def _resume_path(resume: str | None, ckpt_dir: Path) -> Path | None:
    if resume is None:
        return None
    if resume == "latest":
        return ckpt.latest(ckpt_dir)  # None: nothing saved yet, start fresh
    p = Path(resume)
    if ckpt.is_complete(p):
        return p
    found = ckpt.latest(p) or ckpt.latest(p / "checkpoints")
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
    from ..models import build_model

    plan = load(plan_path, overrides)
    errs = ErrorList()
    cfg = parse_run_config(plan, errs)
    errs.raise_if_any()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dims = plan.parallel_dims(world)
    accum, micro = _batch_checks(cfg, dims, errs)
    errs.raise_if_any()
    model = build_model(plan.model, device="meta", real_buffers=True)
    plan.check(model, world)  # patterns, divisibility, seq_len under SP: located errors
    max_len = getattr(getattr(model, "config", None), "max_seq_len", None)
    if max_len is not None and cfg.train.seq_len > max_len:
        errs.add(f"train.seq_len={cfg.train.seq_len} exceeds the model's max_seq_len={max_len}",
                 cfg.train.locs.get("seq_len"))
    corpus = load_corpus(cfg.data.path, cfg.data.max_bytes)
    vocab = _vocab_size(model)
    if vocab is not None and corpus.vocab_size > vocab:
        errs.add(f"the data has tokens up to {corpus.vocab_size - 1} but the model's vocabulary "
                 f"is {vocab}", cfg.data.locs.get("path", plan.mesh.loc))
    if len(corpus) < cfg.train.seq_len + 2:
        errs.add(f"the data has {len(corpus)} tokens, fewer than one sequence of "
                 f"{cfg.train.seq_len} + 1", cfg.data.locs.get("path", plan.mesh.loc))
    errs.raise_if_any()
    run_dir = Path(cfg.metrics.run_dir or Path("runs") / Path(plan_path).stem)
    ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
    resume_from = _resume_path(resume, ckpt_dir)
    if resume_from is not None:
        _check_same_model(resume_from, model)
    elif resume is None and not overwrite and ckpt.latest(ckpt_dir) is not None:
        raise TrainError(f"{ckpt_dir} already holds checkpoints of an earlier run: pass --resume "
                         f"to continue it, --overwrite to start over, or "
                         f"--set metrics.run_dir=<new folder>")
    return Prepared(plan, cfg, dims, model, corpus, accum, micro, run_dir, ckpt_dir, resume_from)


