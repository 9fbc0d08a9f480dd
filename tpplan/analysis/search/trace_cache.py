"""Dry runs of many variants of one plan in one process, sharing what their traces share.

``tpplan search`` checks thousands of layouts of one plan; a dry run's time is almost all
in two traces: the trainer's step on fake tensors (memory) and one micro-batch's TP
collectives on meta (communication). :class:`Evaluator` runs each candidate through the dry
run's own checks and analyses (``analyze_memory``, ``analyze_comm``: ``validate``'s) in one
fake process group, handing them a cached trace wherever a candidate's would be the same as
one run already, keyed by everything the trace reads that can differ between the candidates
of one plan (the mesh, checkpointing, the micro-batch, the pipeline section); docs/search.md
says why each key is complete.

- Check (sections, resolution): a candidate's resolution keyed by tp, pp, cp, ep, its data
  parallelism as resolve reads it, what the stage split reads of the pipeline and the
  checkpointing blocks, the candidate's own mesh degrees put back in; each of its parts and
  each section of the plan cached by what it reads (:mod:`tpplan.analysis.search.check_cache`).
- Memory (:func:`tpplan.analysis.memory.per_rank.memory_per_rank`, the whole model or one pipeline
  stage): keyed by tp, dp_shard, cp (and its method), ep, whether dp_replicate and pp are
  above 1, seq_len, micro-batch, the micro-batches the trace runs (``min(accumulation,
  3)``), dtypes, checkpointing mode and period, the stage's ends and structure and what it
  receives; not the schedule and its micro-batches, combined per candidate afterwards
  (:mod:`tpplan.analysis.memory.stages`).
- TP collectives (:func:`tpplan.analysis.comm.tp_trace.trace_tp`): keyed by tp, seq_len,
  micro-batch, compute dtype, checkpointing mode and period; past three micro-batch sizes,
  extrapolated from them where checked affine (:func:`tpplan.analysis.comm.tp_batch.
  traced_in_batch`). Accumulation, FSDP and pipeline traffic are arithmetic on top, per
  candidate (``analyze_comm``); a pipeline's stages are cached by
  :mod:`tpplan.analysis.comm.stages` in :attr:`Evaluator.stages`.
"""

from __future__ import annotations

import copy
import functools
from collections import Counter
from typing import Any, Callable, Sequence

import torch.nn as nn

from ...api import Plan
from ...checkpoint import checkpoint_bytes
from ...models import build_model
from ...parallel.lora.sizes import checkpointed
from ...parallel.mesh import ParallelDims
from ...parallel.pipeline.split import StageBuilder
from ...plan import ErrorList, PlanError, PlanErrors, parse_plan, read_document, step_shape
from ...plan.loader import overridden
from ...plan.pipeline import split_reads
from ...plan.sections import require_model
from ...plan.specs import PlanSpec
from ...plan.step import StepShape
from ...plan.styles import ep_borrows_tp
from ..analyses import analyze_comm, analyze_memory
from ..dryrun import DryRun, run_analysis
from ..memory.floor import memory_floor
from ..memory.per_rank import first_depths, first_forward, memory_per_rank, shallow_depths
from ..memory.step import ModelBuilder, StageIO
from ..comm.tp_batch import traced_in_batch
from .check_cache import PartCache
from ..comm.tp_trace import trace_tp
from ..comm.stage_bound import tp_key

__all__ = ["Evaluator"]


def _signature(module: nn.Module, blocks: str | None = None, depth: int = 0) -> tuple:
    """A module's structure without its names: each submodule's type and its parameters'
    shapes and dtypes, in order (two stages of as many blocks, at the same ends, agree).
    With ``blocks``: only the first ``depth`` of that container's blocks count (the ones a
    shallow trace runs)."""
    skipped: set[int] = set()
    if blocks is not None:
        for block in list(module.get_submodule(blocks).children())[depth:]:
            skipped.update(id(m) for m in block.modules())
    return tuple((type(m).__name__, tuple((n, tuple(p.shape), p.dtype)
                                          for n, p in m.named_parameters(recurse=False)))
                 for m in module.modules() if id(m) not in skipped)


def _signed(memo: dict, build: StageBuilder | ModelBuilder, blocks: str | None = None,
            depth: int = 0) -> tuple:
    """:func:`_signature` of what ``build`` makes (a stage of the one model, or the model),
    read in place, kept in ``memo`` by the blocks and extras the stage owns."""
    own = (build.stage.blocks, build.stage.extras) if isinstance(build, StageBuilder) else None
    if (own, blocks, depth) not in memo:
        memo[own, blocks, depth] = build.read(lambda module: _signature(module, blocks, depth))
    return memo[own, blocks, depth]


def _mesh_key(dims: ParallelDims, spec: PlanSpec) -> tuple:
    """What a memory trace reads of the mesh: every degree but dp_replicate's size (no
    storage depends on it), and the context-parallel method where there is cp."""
    cp = spec.context_parallel
    return (dims.tp, dims.dp_shard, dims.dp_replicate > 1, dims.pp > 1, dims.cp, dims.ep,
            dims.ep_borrows_tp, (cp.method, cp.load_balance) if dims.cp > 1 else None)


class Evaluator:
    """One plan (``plan_path`` with ``overrides``) at ``world_size``: :meth:`check` a variant
    (``--set`` lines) as ``dry_run`` checks it, then :meth:`memory` and :meth:`comm` analyse
    it as ``validate`` does, through the caches. Analyses need :func:`fake_process_group`
    of ``world_size`` up. ``traces`` counts the traces run and the cache's answers."""

    def __init__(self, plan_path: str, overrides: Sequence[str], world_size: int):
        self.path, self.world_size = str(plan_path), world_size
        try:
            self.doc = read_document(plan_path, overrides)
        except PlanError as e:
            raise PlanErrors([e]) from None
        self.base = parse_plan(self.doc, self.path)
        self.model = build_model(require_model(self.base), device="meta")  # never applied: shared
        # Every candidate's model: cut copies of the one above for the shallow traces.
        self.builder = ModelBuilder(lambda: build_model(require_model(self.base), "meta"), self.model)
        self.checkpoint = checkpoint_bytes(self.model,
                                           saved=checkpointed(self.base.lora, self.model))
        self.meshes: dict[ParallelDims, Any] = {}
        self.parts = PartCache(overrides)  # check's parts: the sections, the resolutions
        self.memories: dict[tuple, tuple] = {}
        self.shallow: dict[tuple, tuple] = {}  # memory's shallow traces, any depth
        self.tp_traces: dict[tuple, Any] = {}
        self.signatures: dict[tuple, tuple] = {}  # _signed's, of this model's stages
        self.units: dict[tuple, list] = {}
        self.states: dict[tuple, tuple] = {}  # memory_floor's sharded state, by degrees
        self.traces: Counter = Counter()
        self.scaled: dict[Any, Any] = {"counts": self.traces}  # memory's steps, any dp_shard
        # pipeline_comm's cache of stages and their traces; it counts into ours
        self.stages: dict[Any, Any] = {"counts": self.traces}
        self._last: ParallelDims | None = None

    def check(self, sets: Sequence[str]) -> DryRun:
        """The plan with ``sets``: its errors (sections, model, batch against the mesh) or
        its resolution and step, exactly as :func:`tpplan.analysis.dryrun.dry_run` finds them
        (each part cached by what it reads: :mod:`tpplan.analysis.search.check_cache`)."""
        result = DryRun(self.world_size)
        self.parts.variant(sets)
        try:
            doc = overridden(self.doc, sets)
            spec = parse_plan(doc, self.path, self.parts.sections)
            result.plan, result.model = Plan(spec, doc), self.model
            result.checkpoint_bytes = self.checkpoint
            res = result.resolution = self._resolve(spec)
            errs = ErrorList(res.errors)
            if res.dims is not None:
                result.step = step_shape(spec, res.dims.dp, res.dims.tp, errs)
            errs.raise_if_any()
        except PlanError as e:
            result.errors = [e]
        except PlanErrors as e:
            result.errors = e.errors
        return result

    def _resolve(self, spec: PlanSpec):
        try:
            dims = ParallelDims.of(spec.mesh, self.world_size, ep_borrows_tp(spec.rules))
        except PlanErrors:  # resolve reports it, and checks the rest against the plan's tp
            return Plan(spec, None).resolve(self.model, self.world_size, self.parts)
        ac = spec.activation_checkpointing
        key = ("resolution", _resolution_key(spec, dims), ac.enabled and ac.blocks)

        def run(errs: ErrorList):
            self.traces["resolutions"] += 1
            res = Plan(spec, None).resolve(self.model, self.world_size, self.parts)
            errs.extend(res.errors)  # where they are located: PartCache's check
            return res
        return _with_dims(self.parts(key, ErrorList(), run), dims)

    def _mesh(self, dims: ParallelDims):
        if dims not in self.meshes:
            self.meshes[dims] = dims.build_mesh("cpu")
        # DTensor's caches key on meshes that compare equal across groups (dryrun's
        # forget_meshes) and are kept: every mesh here lives as long as the search, and a
        # collective on an equal mesh's group is counted on the dimension it was made for
        # (tp_model's _Dims).
        self._last = dims
        return self.meshes[dims]

    def memory(self, result: DryRun, over: Callable[[int], bool] | None = None) -> None:
        """``memory_per_rank`` (and ``pipeline``) as ``validate`` computes them; with
        ``over``, a pipeline's stages only until a pp rank's peak is over (its figures)."""
        result.mesh = self._mesh(result.resolution.dims)
        run_analysis(result, "memory_per_rank",
                     lambda r: analyze_memory(r, self._memory, over))

    def comm(self, result: DryRun) -> None:
        """``comm_per_step`` as ``validate`` computes it (not ``comm_minimum``, which the
        ranking does not read). A whole model's FSDP units are cached by the resolution's
        key and dp_shard (all that :func:`unit_sizes` reads); a pipeline's stages by
        :func:`tpplan.analysis.comm.stages.pipeline_comm` in :attr:`stages`."""
        result.mesh = self._mesh(result.resolution.dims)
        self.fsdp_units(result)
        run_analysis(result, "comm_per_step",
                     lambda r: analyze_comm(r, self._tp, self.stages, minimum=False))

    def fsdp_units(self, result: DryRun) -> list | None:
        """A whole model's FSDP2 units (``result.fsdp_units``), cached by the resolution's key
        and dp_shard (all that :func:`unit_sizes` reads); None under a pipeline, whose units
        are its stages' (:mod:`tpplan.analysis.comm.stages`)."""
        if result.plan.spec.pipeline is not None:
            return None
        dims = result.resolution.dims
        key = (_resolution_key(result.plan.spec, dims), dims.dp_shard)
        if key not in self.units:
            self.units[key] = result.fsdp_units
        result.__dict__["fsdp_units"] = self.units[key]  # the cached_property's slot
        return self.units[key]

    def floor(self, result: DryRun, over: Callable[[int], bool] | None = None) -> int:
        """:func:`tpplan.analysis.memory.floor.memory_floor` of ``result`` (``over``: its own):
        a lower bound of its memory peak from the first forward of its step (cached as the
        whole trace is, less the data-parallel split and the accumulation)."""
        dims = result.resolution.dims
        result.mesh = self._mesh(dims)
        spec, pipe = result.plan.spec, result.plan.spec.pipeline
        # A pipeline's stages and their activations: the probe's key less the stage (the
        # split gives it), and what the split reads (not the schedule's micro-batches).
        stages = pipe and ("stages", self._key(spec, result.step, None, True, True),
                           *split_reads(pipe, dims.pp))
        if stages in self.states:
            self.traces["first_forward_stages_cached"] += 1
        return memory_floor(result, functools.partial(self._memory, first=True), self.states,
                            stages, over)

    def _key(self, spec: PlanSpec, shape: StepShape, blocks: str | None, cut: bool,
             first: bool) -> tuple:
        """A memory trace's key (``first``: a first forward's) but its depth and stage."""
        ac = spec.activation_checkpointing
        # The whole step runs min(accumulation, 3) micro-batches. Its first forward is
        # read for its activations only, which no data-parallel split or accumulation
        # changes: keyed without them (the probe runs on the first candidate's mesh).
        mesh_key = _mesh_key(self._last, spec)
        return (first, (mesh_key[0], *mesh_key[3:]) if first else mesh_key, shape.seq_len,
                shape.micro_batch, 1 if first else min(shape.grad_accum, 3),
                shape.param_dtype, shape.reduce_dtype, ac.mode, ac.every, blocks, cut)

    def _memory(self, spec: PlanSpec, mesh, build: Callable[[], nn.Module], shape: StepShape,
                n_blocks: int, blocks: str | None, cut: bool = True,
                io: StageIO | None = None, first: bool = False) -> dict[str, Any]:
        build = build if isinstance(build, StageBuilder) else self.builder  # the same model
        signature = functools.partial(_signed, self.signatures, build)  # read in place
        stage = io and (io.first, io.last, io.received, signature())
        common = self._key(spec, shape, blocks, cut, first)
        key = (*common, n_blocks, stage)
        name = "first_forward" if first else "memory"
        if key not in self.memories:
            # A deep model's shallow traces read its first blocks (memory's up to 6k, the
            # first forward's r + 4k) and around them: shared by every depth (any pp).
            # Any depth from the shallowest that takes them (the deepest traced) shares
            # them: a shorter alike model or stage reuses them where they are kept already.
            depths = first_depths(spec, n_blocks, blocks, cut) if first else \
                shallow_depths(spec, n_blocks, blocks, cut, True)
            shallow = depths and (self.shallow, (*common, io and (io.first, io.last, io.received),
                                                 signature(blocks, depths[-1])))
            if not first and shallow and shallow[1] not in self.shallow:  # worth tracing?
                depths = shallow_depths(spec, n_blocks, blocks, cut)
            before = len(self.shallow)
            if first:
                out = first_forward(spec, mesh, build, shape, n_blocks, blocks, cut, io, shallow)
            else:  # each step traced serves every dp_shard it scales to exactly
                family = (common[0], (common[1][0], *common[1][2:]), *common[2:], n_blocks, stage)
                out = memory_per_rank(spec, mesh, build, shape, n_blocks, blocks, cut, io,
                                      shallow, (self.scaled, family, self._last.dp_shard))
            self.memories[key] = (out, io.sent if io else None)
            self.traces[name if len(self.shallow) > before or not depths
                        else f"{name}_from_shallow"] += 1
        else:
            self.traces[f"{name}_cached"] += 1
        out, sent = self.memories[key]
        if io is not None:
            io.sent = sent
        out = copy.deepcopy(out)
        if not first:
            out["batch"]["grad_accum"] = shape.grad_accum  # the trace runs min(accumulation, 3)
        return out

    def _tp(self, plan: PlanSpec, res, mesh, build: Callable[[], nn.Module], seq_len: int,
            micro_batch: int, dtype) -> Any:
        # Keyed without the micro-batch: past three sizes, extrapolated where checked
        # (tp_batch.traced_in_batch). ``builder`` copies the plan's one model, as ``build``
        # would. A period kept: pipeline layouts' bounds (interior.interior_rows).
        key = tp_key(plan, res.dims, seq_len, dtype)
        trace = traced_in_batch(self.tp_traces, key, micro_batch, None, lambda b, _: (
            trace_tp(plan, res, mesh, self.builder, seq_len, b, dtype), None), self.traces, "tp")[0]
        if trace.period is not None:
            self.tp_traces["period", key, micro_batch] = trace.period
        return trace


def _resolution_key(spec: PlanSpec, dims: ParallelDims) -> tuple:
    """What a resolution reads that differs between candidates (docs/search.md)."""
    pipe = spec.pipeline
    return (dims.tp, dims.pp, dims.ep, dims.ep_borrows_tp, dims.cp, dims.dp if spec.fsdp is None else dims.dp > 1,
            pipe and split_reads(pipe, dims.pp))


def _with_dims(res, dims: ParallelDims):
    """A shallow copy of a cached resolution with this candidate's own mesh degrees."""
    out = copy.copy(res)
    out.dims = dims
    return out
