"""Pipeline stages as module paths: which stage owns which part of the model, on which rank.

:func:`split_stages` reads only the model's module tree and parameter shapes, so it runs the
same on a meta model (the dry run), a CPU model (verify) or a real one, and needs no process
group. :func:`stage_module` builds one stage from the whole model: a copy of the root holding
only what the stage owns, everything else ``None`` (torchtitan's approach: build the whole
model on meta, delete what a stage does not own). Names stay the whole model's
(``layers.8.attention.wq.weight`` on whichever stage holds block 8), so plan patterns,
seeded init and checkpoint keys are the same on every pipeline degree. The contract a model
must meet is in docs/pipeline.md.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import torch.nn as nn

from ..._torch.modules import own_children, set_children, swapped
from ...plan.errors import ErrorList, nearest
from ...plan.pipeline import SCHEDULES
from ...plan.specs import PipelineSpec, PlanSpec

__all__ = ["PipelineSplit", "Stage", "StageBlocks", "StageBuilder", "split_stages", "stage_module",
           "stage_ranks", "stage_view"]


class StageBlocks(nn.ModuleDict):
    """A stage's blocks under their whole-model keys (``"8"``, ``"9"``, ...), iterated like
    the ``ModuleList`` they came from: ``for block in self.layers`` yields the blocks, so a
    model's forward runs unchanged on a stage."""

    def __iter__(self):
        return iter(self.values())


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: its index in the pipeline, the pp rank that runs it, and the
    module paths it owns (the blocks in order, plus the embedding on the first stage and
    what follows the blocks on the last)."""

    index: int
    rank: int
    blocks: tuple[str, ...]
    extras: tuple[str, ...]  # non-block children of the root this stage owns
    params: int  # parameters it owns (elements)

    @property
    def modules(self) -> tuple[str, ...]:
        return self.extras + self.blocks if self.index == 0 else self.blocks + self.extras


@dataclass
class PipelineSplit:
    """Every stage of the pipeline, in order; ``errors`` are located at the plan's lines."""

    stages: list[Stage] = field(default_factory=list)
    blocks_path: str = ""  # the root's child holding the blocks (``layers``)
    first: tuple[str, ...] = ()  # root children before the blocks: on the first stage
    last: tuple[str, ...] = ()  # root children after them: on the last stage
    pp: int = 1
    errors: ErrorList = field(default_factory=ErrorList)

    def of_rank(self, pp_rank: int) -> list[Stage]:
        """The stages pp rank ``pp_rank`` runs, in pipeline order."""
        return [s for s in self.stages if s.rank == pp_rank]

    def stage_of(self, path: str) -> Stage | None:
        """The stage owning module or parameter ``path`` (None for the root's own)."""
        for s in self.stages:
            if any(path == m or path.startswith(m + ".") for m in s.modules):
                return s
        return None


def stage_ranks(stages: int, pp: int, v_shape: bool) -> list[int]:
    """pp rank of each stage: round robin (stage ``s`` on rank ``s % pp``), or a V for the
    zero-bubble V schedules (rank ``r`` holds stages ``r`` and ``2·pp-1-r``)."""
    if v_shape:
        return [s if s < pp else 2 * pp - 1 - s for s in range(stages)]
    return [s % pp for s in range(stages)]


def _find_blocks(model: nn.Module) -> str | None:
    """The path of the repeated blocks: the model's ``stage_blocks`` if it names them (an HF
    decoder: ``model.layers``), else the root's largest ModuleList/ModuleDict child."""
    declared = getattr(model, "stage_blocks", None)
    if declared:
        return declared
    best, size = None, 0
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)) and len(child) > size:
            best, size = name, len(child)
    return best


def _around(model: nn.Module, blocks: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The modules before and after the blocks, as paths: at each level from the root down
    to the blocks' parent, the siblings registered before go first, those after go last;
    those the model names in ``stage_shared`` (rotary tables) stay on every stage."""
    first: list[str] = []
    last: list[str] = []
    shared = set(getattr(model, "stage_shared", ()))
    parts = blocks.split(".")
    parent = model
    for depth, name in enumerate(parts):
        prefix = ".".join(parts[:depth])
        children = [n for n, _ in parent.named_children()]
        at = children.index(name)
        paths = [f"{prefix}.{n}" if prefix else n for n in children]
        first += [p for p in paths[:at] if p not in shared]
        last[:0] = [p for p in paths[at + 1:] if p not in shared]
        parent = getattr(parent, name)
    return tuple(first), tuple(last)


def _count(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def _balanced(weights: list[int], first: int, last: int, stages: int) -> list[int]:
    """Start indices of stages 2.. over contiguous blocks, each stage at least one block,
    minimizing the heaviest stage (``first``/``last``: the extra weight of the ends)."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    def cost(i: int, j: int, s: int) -> int:  # blocks i..j-1 as stage s
        return prefix[j] - prefix[i] + (first if s == 0 else 0) + (last if s == stages - 1 else 0)

    inf = float("inf")
    # best[s][j]: the heaviest stage when stages 0..s hold blocks 0..j-1
    best = [[inf] * (n + 1) for _ in range(stages)]
    cut = [[0] * (n + 1) for _ in range(stages)]
    for j in range(1, n + 1):
        best[0][j] = cost(0, j, 0)
    for s in range(1, stages):
        for j in range(s + 1, n + 1):
            for i in range(s, j):
                c = max(best[s - 1][i], cost(i, j, s))
                if c < best[s][j]:
                    best[s][j], cut[s][j] = c, i
    starts, j = [], n
    for s in range(stages - 1, 0, -1):
        j = cut[s][j]
        starts.append(j)
    return starts[::-1]


def split_stages(model: nn.Module, spec: PlanSpec, pp: int | None = None) -> PipelineSplit:
    """The stages of ``spec.pipeline`` on ``pp`` ranks (default ``spec.mesh.pp``); never
    raises: what does not fit is in ``errors``, located at the plan's ``pipeline`` lines.

    ``split: auto`` cuts the blocks into ``pp × stages_per_rank`` contiguous runs that
    balance parameters, the root's children before the blocks (the embedding) counted on
    the first stage and those after them (final norm, head) on the last."""
    pipe: PipelineSpec = spec.pipeline
    pp = pp or spec.mesh.pp
    out = PipelineSplit(pp=pp)
    errs = out.errors
    why = getattr(model, "stage_refusal", None)  # set by the model's source (HF: models/hf_stages.py)
    if why:
        errs.add(f"this model cannot be split into pipeline stages: {why} (docs/pipeline.md, "
                 "'HuggingFace models')", pipe.loc)
        return out
    blocks = _find_blocks(model)
    if blocks is None:
        errs.add("pipeline stages need the model's blocks in a ModuleList or ModuleDict that is "
                 "a direct child of the model (like 'layers'); found none", pipe.loc)
        return out
    out.blocks_path = blocks
    out.first, out.last = _around(model, blocks)
    container = model.get_submodule(blocks)
    keys = [k for k, _ in container.named_children()]
    paths = [f"{blocks}.{k}" for k in keys]
    weights = [_count(m) for m in container.children()]
    stages = pp * pipe.stages_per_rank
    if len(paths) < stages:
        errs.add(f"{stages} pipeline stages (mesh.pp={pp} × stages_per_rank="
                 f"{pipe.stages_per_rank}) but the model has {len(paths)} blocks in "
                 f"'{blocks}': every stage needs at least one", pipe.loc)
        return out
    if pipe.split == "auto":
        first = sum(_count(model.get_submodule(n)) for n in out.first)
        last = sum(_count(model.get_submodule(n)) for n in out.last)
        starts = _balanced(weights, first, last, stages)
    else:
        starts = _explicit(pipe, paths, errs)
        if errs:
            return out
    ranks = stage_ranks(stages, pp, SCHEDULES[pipe.schedule].v_shape)
    bounds = [0, *starts, len(paths)]
    for s in range(stages):
        extras = out.first if s == 0 else ()
        extras += out.last if s == stages - 1 else ()
        own = tuple(paths[bounds[s]:bounds[s + 1]])
        params = sum(weights[bounds[s]:bounds[s + 1]]) + sum(
            _count(model.get_submodule(n)) for n in extras)
        out.stages.append(Stage(s, ranks[s], own, extras, params))
    return out


def _explicit(pipe: PipelineSpec, paths: list[str], errs: ErrorList) -> list[int]:
    """Block indices where stages 2.. start, from ``pipeline.split``; errors located."""
    starts: list[int] = []
    for i, point in enumerate(pipe.split):
        loc = pipe.split_locs[i] if i < len(pipe.split_locs) else pipe.where
        if point not in paths:
            errs.add(f"pipeline.split point '{point}' is not a block of the model; stages start "
                     f"at a block ({paths[0]} ... {paths[-1]}){nearest(point, paths)}", loc)
            continue
        index = paths.index(point)
        if index == 0:
            errs.add(f"pipeline.split point '{point}' is the first block: the first stage "
                     "would hold no block", loc)
        elif starts and index == starts[-1]:
            errs.add(f"pipeline.split point '{point}' is named twice: the stage between would "
                     "be empty", loc)
        elif starts and index < starts[-1]:
            errs.add(f"pipeline.split points must be in the model's order: '{point}' comes "
                     f"before '{paths[starts[-1]]}'", loc)
        starts.append(index)
    return starts


@contextlib.contextmanager
def stage_view(model: nn.Module, stage: Stage, split: PipelineSplit, keep: int | None = None):
    """``model`` itself cut in place to what :func:`stage_module` copies of ``stage`` (same
    modules, same order; the root keeps ``model``'s class), put back on leaving: a stage
    read (its blocks, its parameters' names and shapes) without a copy."""
    owned = set(stage.extras)
    mine = {p.rsplit(".", 1)[1] for p in stage.blocks[:keep]}
    edits: dict[str, nn.Module | None] = {p: None for p in split.first + split.last if p not in owned}
    container = model.get_submodule(split.blocks_path)
    if isinstance(container, nn.ModuleList):
        kept = StageBlocks({k: b for k, b in container.named_children() if k in mine})
    else:
        kept = copy.copy(container)
        set_children(kept, {k: v for k, v in own_children(container).items() if k in mine})
    edits[split.blocks_path] = kept
    with swapped(model, children=edits):
        yield model


def stage_module(model: nn.Module, stage: Stage, split: PipelineSplit,
                 keep: int | None = None) -> nn.Module:
    """A new root holding only what ``stage`` owns, copied from ``model`` (whose parts are
    left as they were): the modules around the blocks it does not own are ``None`` and the
    blocks container holds only its blocks under their whole-model keys
    (:class:`StageBlocks`). Only the owned parts are copied, so a meta model costs nothing
    and a real one costs what the stage holds. A model with a ``stage_forward`` (an HF
    decoder) runs it on the stage in place of its own forward. ``keep``: only the first
    ``keep`` of the stage's blocks are copied (what a shallow trace of the stage runs: the
    stage cut there after a whole copy, without copying the rest)."""
    with stage_view(model, stage, split, keep) as view:  # nothing but the stage is copied
        out = copy.deepcopy(view)
    forward = getattr(model, "stage_forward", None)
    if forward is not None:
        out.__class__ = _stage_class(type(model), forward)
    return out


class StageBuilder:
    """A new copy of ``stage``'s module (:func:`stage_module`) at each call, with
    ``blocks`` only its first ``blocks`` blocks (all a shallow trace runs); :meth:`read`
    reads the stage without a copy."""

    def __init__(self, model: nn.Module, stage: Stage, split: PipelineSplit):
        self.model, self.stage, self.split = model, stage, split

    def read(self, fn: Callable[[nn.Module], Any]) -> Any:
        """``fn`` of :func:`stage_view` of the stage (to read only, keeping nothing of it)."""
        with stage_view(self.model, self.stage, self.split) as view:
            return fn(view)

    def __call__(self, blocks: int | None = None) -> nn.Module:
        return stage_module(self.model, self.stage, self.split, blocks)


_STAGE_CLASSES: dict[tuple[type, object], type] = {}


def _stage_class(cls: type, forward) -> type:
    """``cls`` with ``forward`` as its forward (one class per model class)."""
    key = (cls, forward)
    if key not in _STAGE_CLASSES:
        _STAGE_CLASSES[key] = type(f"Stage{cls.__name__}", (cls,), {"forward": forward})
    return _STAGE_CLASSES[key]
