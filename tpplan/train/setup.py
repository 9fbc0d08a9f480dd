"""Everything checked before ``init_process_group``, so a mistake fails every rank together.

Every rank parses the same plan, reads the same corpus and looks at the same run folder;
each finds the same mistake and exits non-zero before any collective could hang. Which
checkpoints a resumed run may start from is decided here too (newest first); which of them
is intact is checked after the process group starts (:mod:`.resume`), by all ranks at once.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from .. import checkpoint as ckpt
from ..api import Plan, load
from ..models import build_model
from ..models.init import constructor_problems
from ..models.introspect import vocab_size
from ..parallel.mesh import ParallelDims
from ..parallel.lora.sizes import checkpointed
from ..parallel.runtime import restart_problem
from ..plan import ErrorList, PlanErrors, StepShape
from . import pretrained
from .corpora import load_corpora, open_feed
from .data import Corpus, CorpusFeed, DataError
from .runfolder import launch_id, preflight, read_launch
from .sinks import missing as missing_sink

__all__ = ["Prepared", "TrainError", "check_before_launch", "check_init", "prepare", "run_folders"]


class TrainError(Exception):
    """A mistake outside the plan file (command line, run folder, checkpoint), or a run that
    cannot go on. Raised on every rank alike and said once, by rank 0 -- unless
    ``every_rank``: a failure only some ranks see (another rank died), said by each."""

    def __init__(self, message: str, every_rank: bool = False):
        super().__init__(message)
        self.every_rank = every_rank


@dataclass
class Prepared:
    plan: Plan  # its sections: plan.train, plan.data, plan.checkpoint, plan.metrics
    dims: ParallelDims
    step: StepShape  # micro-batch and accumulation per data-parallel rank
    model: nn.Module  # on the meta device, not yet parallelized
    corpus: Corpus | None  # the corpus read whole (text, bytes); None for token sources
    run_dir: Path
    ckpt_dir: Path
    # Checkpoints to resume from, newest first; the first intact one is used. Empty: fresh.
    candidates: list[Path] = field(default_factory=list)
    explicit: bool = False  # --resume named one step folder: no falling back
    restarted: bool = False  # torchrun restarted this launch's workers
    overwrite: bool = False  # a fresh start that removes what an earlier run wrote
    notes: list[str] = field(default_factory=list)  # shown under the header on rank 0
    pretrained: pretrained.Pretrained | None = None  # model.pretrained, checked
    eval_corpus: Corpus | None = None  # held-out data (the eval section), None: no eval
    lora_base: dict | None = None  # with lora: the frozen base's identity, saved and checked
    adapter: dict | None = None  # model.adapter's tensors (tpplan's names), checked
    feed: Any = None  # each step's batch: a TokenFeed (token sources) or a CorpusFeed


def run_folders(plan: Plan, plan_path: str) -> tuple[Path, Path]:
    """(run folder, checkpoint folder) of a plan."""
    run_dir = Path(plan.metrics.run_dir or Path("runs") / Path(plan_path).stem)
    return run_dir, Path(plan.checkpoint.dir) if plan.checkpoint.dir else run_dir / "checkpoints"


def _candidates(resume: str, ckpt_dir: Path) -> tuple[list[Path], bool]:
    """Checkpoints ``--resume`` may start from, newest first, and whether it named one."""
    if resume == "latest":
        return ckpt.complete_checkpoints(ckpt_dir), False  # empty: nothing saved, start fresh
    path = Path(resume)
    if ckpt.is_step_folder(path) and path.is_dir():
        if not ckpt.is_complete(path):
            raise TrainError(f"--resume {resume}: an incomplete checkpoint (a save that did "
                             f"not finish); resume from the folder holding it to use the "
                             f"newest complete one")
        return [path], True
    found = ckpt.complete_checkpoints(path) or ckpt.complete_checkpoints(path / "checkpoints")
    if not found:
        raise TrainError(f"--resume {resume}: not a complete checkpoint, and no complete "
                         f"checkpoint (step-N/ with .metadata, {ckpt.TRAINER_FILE} and "
                         f"manifest.json) inside")
    return found, False


def _pipeline_limits(plan: Plan, errs: ErrorList) -> None:
    """What ``tpplan train`` does not run under pipeline stages yet (docs/pipeline.md)."""
    if plan.eval.enabled:
        errs.add("the 'eval' section is not supported with pipeline stages yet (the held-out "
                 "loss would need the schedule's eval); remove it or set mesh.pp=1",
                 plan.eval.loc)
    if plan.model is not None and plan.model.pretrained:
        errs.add("model.pretrained is not supported with pipeline stages yet; set mesh.pp=1",
                 plan.model.locs.get("pretrained", plan.model.loc))


def _check_sections(plan: Plan, world: int) -> tuple[ParallelDims, StepShape]:
    """The mistakes found without the model, all at once: the data path, the mesh and the
    batch against it, the pipeline's limits, the profile window."""
    t, data = plan.train, plan.data
    errs = ErrorList()
    where = data.locs.get("path", data.loc)
    path = data.resolved(data.path)
    if path is not None and not Path(path).exists() and not Path(path + ".idx").exists():
        errs.add(f"data.path '{data.path}' does not exist (a text file, a folder of text files, a token "
                 f"store, a Megatron prefix, a file of ids with data.dtype; null = the Python standard "
                 f"library)", where)
    try:  # reported together with the data path: every mistake at once
        dims = plan.parallel_dims(world)
        step = plan.step_shape(world)  # the batch against the mesh, seq_len under SP
    except PlanErrors as e:
        errs.extend(e.errors)
    if plan.pipeline is not None:
        _pipeline_limits(plan, errs)
    profile = plan.metrics.profile
    if profile is not None and profile[1] > t.steps:
        errs.add(f"metrics.profile {profile[0]}:{profile[1]} ends after the last step "
                 f"(train.steps={t.steps})", plan.metrics.locs.get("profile", plan.metrics.loc))
    errs.raise_if_any()
    return dims, step


def _check_data(plan: Plan, corpus: Corpus, ev: Corpus | None, vocab: int | None, step: StepShape) -> None:
    """The data against the model's vocabulary and one global batch, the held-out data too."""
    t, errs = plan.train, ErrorList()
    where = plan.data.locs.get("path", plan.data.loc)
    if vocab is not None and corpus.vocab_size > vocab:
        errs.add(f"the data has tokens up to {corpus.vocab_size - 1} but the model's vocabulary "
                 f"is {vocab}", where)
    if len(corpus) < t.seq_len + 2:
        errs.add(f"the data has {len(corpus)} tokens, fewer than one sequence of "
                 f"{t.seq_len} + 1", where)
    elif corpus.packed and corpus.windows(t.seq_len) < step.global_batch:
        errs.add(f"the data packs into {corpus.windows(t.seq_len)} windows of {t.seq_len} "
                 f"tokens, fewer than one global batch of {step.global_batch}", where)
    if ev is not None and ev.windows(t.seq_len) < step.global_batch:
        errs.add(f"the held-out data has {ev.windows(t.seq_len)} windows of {t.seq_len} tokens, "
                 f"fewer than one global batch of {step.global_batch}",
                 plan.eval.locs.get("path", plan.eval.locs.get("fraction", plan.eval.loc)))
    errs.raise_if_any()


def _choose_start(prep: Prepared, resume: str | None, overwrite: bool) -> None:
    """Where the run starts: the checkpoints to resume from (a torchrun restart's own, or
    ``--resume``'s), over what an earlier run wrote (``--overwrite``), or fresh; a run folder
    holding checkpoints is never started over without ``--overwrite``."""
    run_dir, ckpt_dir = prep.run_dir, prep.ckpt_dir
    # torchrun restarting this launch's workers: resume by itself, never wipe (--overwrite
    # applied to the first round only).
    prep.restarted = launch_id() is not None and read_launch(run_dir).get("launch") == launch_id()
    if prep.restarted:
        prep.candidates = ckpt.complete_checkpoints(ckpt_dir)
    elif resume is not None:
        prep.candidates, prep.explicit = _candidates(resume, ckpt_dir)
    elif overwrite:
        prep.overwrite = True
    elif ckpt.latest(ckpt_dir) is not None:
        raise TrainError(f"{ckpt_dir} already holds checkpoints of an earlier run: pass --resume "
                         f"to continue it, --overwrite to start over, or "
                         f"--set metrics.run_dir=<new folder>")


def check_init(plan: Plan, model: nn.Module) -> None:
    """Every parameter has a known initializer (``init_std``, ``reset_parameters()``, or the
    model's constructor replayed under ``train.seed``); else PlanErrors at ``model``, each
    parameter named with the fix."""
    errs = ErrorList()
    spec = plan.model
    for problem in constructor_problems(spec, model, plan.train.seed):
        errs.add(f"cannot initialize the model as its constructor does: {problem}",
                 spec.locs.get("factory", spec.loc))
    errs.raise_if_any()


def check_before_launch(plan_path: str, overrides: Sequence[str], world: int) -> None:
    """The plan's mistakes found before torchrun starts ``world`` workers (each would find
    them too, after starting): the sections, the model against every rule (lora, freeze,
    experts included) and its initializers. Raises PlanErrors."""
    plan = load(plan_path, overrides)
    _check_sections(plan, world)
    model = build_model(plan.require_model(), device="meta", real_buffers=True)
    plan.check(model, world)
    if not plan.model.pretrained:
        check_init(plan, model)


def prepare(plan_path: str, overrides: Sequence[str], resume: str | None,
            overwrite: bool) -> Prepared:
    """Parse and check everything a run needs; raise PlanErrors / TrainError on a mistake."""
    plan = load(plan_path, overrides)  # every section, the trainer's included
    world = int(os.environ.get("WORLD_SIZE", "1"))
    t, data = plan.train, plan.data
    dims, step = _check_sections(plan, world)
    if problem := missing_sink(plan.metrics):
        raise TrainError(problem)
    model = build_model(plan.require_model(), device="meta", real_buffers=True)
    plan.check(model, world)  # patterns, divisibility: located errors
    if not plan.model.pretrained:
        check_init(plan, model)
    source = pretrained.check(plan.model, model) if plan.model.pretrained else None
    adapter = pretrained.check_adapter(plan, model) if plan.model.adapter else None
    max_len = getattr(getattr(model, "config", None), "max_seq_len", None)
    errs = ErrorList()
    if max_len is not None and t.seq_len > max_len:
        errs.add(f"train.seq_len={t.seq_len} exceeds the model's max_seq_len={max_len}",
                 t.locs.get("seq_len", t.loc))
    errs.raise_if_any()
    vocab = vocab_size(model)
    run_dir, ckpt_dir = run_folders(plan, plan_path)
    try:
        feed = open_feed(data, plan.eval, t.seed, step.global_batch, t.seq_len, vocab)
        corpora = None if feed is not None else load_corpora(data, plan.eval, run_dir, vocab, t.seq_len)
    except DataError as e:
        raise TrainError(str(e)) from None
    if corpora is not None:
        _check_data(plan, corpora.train, corpora.eval, vocab, step)
        feed = CorpusFeed(corpora.train, t.seed, step.global_batch, t.seq_len)
    if problem := restart_problem():
        raise TrainError(problem)
    prep = Prepared(plan, dims, step, model, corpora and corpora.train, run_dir, ckpt_dir,
                    eval_corpus=corpora.eval if corpora else feed.held_out, pretrained=source, feed=feed,
                    notes=list(corpora.notes) if corpora else feed.plan_lines(t.steps))
    if plan.lora is not None:
        prep.lora_base = pretrained.base_identity(plan.model, t.seed)
        prep.adapter = adapter
    if plan.checkpoint.enabled:
        size = ckpt.checkpoint_bytes(model, saved=checkpointed(plan.lora, model))  # LoRA: adapters
        problem, warning = preflight(ckpt_dir, size, plan.checkpoint.keep)
        if problem:
            raise TrainError(problem)
        prep.notes += [warning] if warning else []
    _choose_start(prep, resume, overwrite)
    return prep
