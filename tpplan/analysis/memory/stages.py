"""Pipeline stages in the dry run: memory per pp rank with the micro-batches its schedule
keeps in flight, the schedule's bubble, and the point-to-point traffic between stages.

Each stage is built as ``apply_pipeline`` builds it (:func:`tpplan.parallel.pipeline.split.
stage_module` of the meta model, the plan applied with ``stage=True`` on this rank's slice
of the mesh) and its step traced on fake tensors like a whole model's
(:func:`tpplan.analysis.memory.per_rank.memory_per_rank`, three shallow traces for a deep stage),
its micro-batches one after another. A schedule runs them interleaved instead: where it
keeps ``k`` micro-batches in flight on a stage (their forward done, their backward not;
:func:`tpplan.analysis.cost.schedule.in_flight`, from torch's own order), the rank holds ``k``
micro-batches' saved activations where the trace held one. A rank's figures are the sum
of its stages' (each part at its largest), its activations the most that its stages hold
together at any point of the order, and its peak the stages' peaks plus the activations
the schedule holds beyond the one micro-batch each trace held (an upper bound when a rank
holds several stages: their peaks need not coincide). docs/dry-run.md, "Pipeline stages".
"""

from __future__ import annotations

from typing import Any, Callable

import torch.nn as nn

from ...models.introspect import find_blocks
from ...parallel.mesh import ParallelDims
from ...parallel.pipeline.split import PipelineSplit, StageBuilder, split_stages
from ...plan.pipeline import split_reads
from ...plan.specs import PlanSpec
from ...plan.step import StepShape
from .per_rank import memory_per_rank
from .tracker import PARTS
from ..cost.schedule import rank_in_flight, schedule_actions, schedule_facts
from .step import StageIO

__all__ = ["pipeline_schedule", "pipeline_memory", "stage_traces", "p2p_per_rank",
           "reported_ranks"]


def reported_ranks(pp: int) -> dict[int, str]:
    """The pp ranks the dry run reports, by position: the first, one in the middle, the
    last (every rank in between holds what the middle one does, up to the split)."""
    out = {0: "first", pp // 2: "middle", pp - 1: "last"}
    return dict(sorted(out.items()))


def pipeline_schedule(spec: PlanSpec, dims: ParallelDims, split: PipelineSplit) -> dict[str, Any]:
    """The schedule's facts: its bubble (simulated, with the closed form beside it), each
    stage's micro-batches in flight, rank and modules."""
    pipe = spec.pipeline
    pp, v, m = dims.pp, pipe.stages_per_rank, pipe.microbatches
    bubble, flight = schedule_facts(pipe.schedule, pp, v, m)
    closed = {"gpipe": (pp - 1) / m, "1f1b": (pp - 1) / m,
              "interleaved_1f1b": (pp - 1) / (v * m)}.get(pipe.schedule)
    return dict(schedule=pipe.schedule, pp=pp, stages_per_rank=v, microbatches=m,
                bubble_fraction=bubble, bubble_closed_form=closed,
                stages=[dict(index=s.index, pp_rank=s.rank, first_module=s.modules[0],
                             last_module=s.modules[-1], blocks=len(s.blocks), params=s.params,
                             in_flight=flight[s.index]) for s in split.stages])


def kept_split(cache: dict, whole: nn.Module, spec: PlanSpec, pp: int) -> PipelineSplit:
    """:func:`split_stages` of ``whole`` at ``pp``, kept in ``cache`` (one model's) by what
    the split reads of the pipeline section; its errors raised."""
    key = ("split", *split_reads(spec.pipeline, pp))
    if key not in cache:
        split = split_stages(whole, spec, pp)
        split.errors.raise_if_any()
        cache[key] = split
    return cache[key]


def stage_traces(spec: PlanSpec, mesh, build: Callable[[], nn.Module], shape: StepShape,
                 dims: ParallelDims, trace: Callable = memory_per_rank,
                 enough: Callable[[PipelineSplit, dict[int, Any]], bool] | None = None,
                 first: tuple[int, tuple] | None = None, split: PipelineSplit | None = None,
                 ) -> tuple[PipelineSplit, dict[int, Any], tuple | None]:
    """``(split, per_stage, boundary)``: ``trace`` (:func:`memory_per_rank`'s signature) of
    each stage of the :func:`reported_ranks`, by stage index, each stage taking the
    activation the first one sends (``boundary``: its shape and dtype, None for one stage).
    A stage is copied only where ``trace`` builds it (:class:`StageBuilder`: a cached
    trace reads the stage's structure in place, without a copy). ``enough(split,
    per_stage)``, asked after each stage, stops the traces when true (the later stages
    then missing from ``per_stage``); ``first = (pp rank, boundary)``: that rank's stages
    traced before the others, taking ``boundary`` where the first stage is not yet traced;
    ``split``: :func:`split_stages` of ``build()``'s model, where the caller keeps it."""
    whole = build()
    split = split or split_stages(whole, spec, dims.pp)
    split.errors.raise_if_any()
    ranks = reported_ranks(dims.pp)
    last = len(split.stages) - 1
    per_stage: dict[int, Any] = {}
    rank, boundary = first or (None, None)
    for stage in sorted((s for s in split.stages if s.rank in ranks),
                        key=lambda s: (s.rank != rank, s.index)):
        io = StageIO(first=stage.index == 0, last=stage.index == last,
                     received=boundary if stage.index else None)
        build_stage = StageBuilder(whole, stage, split)
        blocks, n_blocks = build_stage.read(_blocks)
        per_stage[stage.index] = trace(spec, mesh, build_stage, shape, n_blocks, blocks, io=io)
        if stage.index == 0 and boundary is not None and io.sent != boundary:
            raise RuntimeError(f"the first stage sends {io.sent}, not the {boundary} the "
                               "stages after it were traced with")
        boundary = boundary or io.sent
        if enough is not None and enough(split, per_stage):
            break
    return split, per_stage, boundary


def _blocks(module: nn.Module) -> tuple[str | None, int]:
    """The path of ``module``'s repeated blocks (:func:`find_blocks`) and how many."""
    blocks = find_blocks(module)
    return blocks, len(module.get_submodule(blocks)) if blocks else 0


def pipeline_memory(spec: PlanSpec, mesh, build: Callable[[], nn.Module], shape: StepShape,
                    dims: ParallelDims, trace: Callable = memory_per_rank,
                    over: Callable[[int], bool] | None = None,
                    first: tuple[int, tuple] | None = None,
                    ) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(memory_per_rank, pipeline)``: the reported pp rank with the largest peak under the
    usual keys, every reported rank in ``pp_ranks``; and :func:`pipeline_schedule`'s facts
    with the activation a stage sends (``boundary``) and the p2p traffic per rank. ``trace``:
    :func:`memory_per_rank` or a function with its signature (``search``'s cache). ``over``:
    true of a peak too large (``search``'s device): once a rank whose stages are all traced
    has such a peak, no further stage is traced, and only the ranks traced whole are
    reported (``stopped_early``: True), that rank among them; ``first``: a pp rank whose
    stages are traced first, and the activation the first stage sends (:func:`stage_traces`)."""
    actions = schedule_actions(spec.pipeline.schedule, dims.pp, spec.pipeline.stages_per_rank,
                               spec.pipeline.microbatches)
    ranks = reported_ranks(dims.pp)
    done: dict[int, dict[str, Any]] = {}
    pipes: list[dict[str, Any]] = []

    def enough(split: PipelineSplit, per_stage: dict[int, Any]) -> bool:
        """Each rank whose stages are all traced, as it is reported; whether one is over."""
        if not pipes:
            pipes.append(pipeline_schedule(spec, dims, split))
        for rank, position in ranks.items():
            mine = [s.index for s in split.of_rank(rank)]
            if rank not in done and all(i in per_stage for i in mine):
                done[rank] = _rank_memory(rank, position, mine, per_stage, actions[rank],
                                          pipes[0])
        return over is not None and any(over(r["peak"]) for r in done.values())

    split, per_stage, boundary = stage_traces(spec, mesh, build, shape, dims, trace, enough,
                                              first)
    pipe = pipes[0]
    out = [done[rank] for rank in ranks if rank in done]
    worst = dict(max(out, key=lambda r: r["peak"]))
    worst["pp_ranks"] = out
    if len(out) < len(ranks):
        worst["stopped_early"] = True
    if boundary is not None:
        shape_, dtype = boundary
        n = 1
        for d in shape_:
            n *= d
        pipe["boundary"] = dict(shape=list(shape_), dtype=str(dtype).removeprefix("torch."),
                                bytes=n * dtype.itemsize)
        pipe["p2p"] = p2p_per_rank(split, spec.pipeline.microbatches, pipe["boundary"]["bytes"])
    return worst, pipe


def _rank_memory(rank: int, position: str, mine: list[int], per_stage: dict[int, Any],
                 actions: list, pipe: dict[str, Any]) -> dict[str, Any]:
    """One pp rank's figures from its stages' traces (``mine``: their indices) and its
    schedule's order (``actions``): each part summed, the activations its order keeps in
    flight, its peak the stages' peaks plus what the order holds beyond one micro-batch each."""
    mems = [per_stage[i] for i in mine]
    acts = {i: per_stage[i]["activations"] for i in mine}
    r: dict[str, Any] = {p: sum(m[p] for m in mems) for p in PARTS}
    r["activations"] = rank_in_flight(actions, acts)
    extra = r["activations"] - sum(acts.values())
    r["total"] = sum(r[p] for p in PARTS)
    r["peak"] = sum(m["peak"] for m in mems) + extra
    r["at_peak"] = {p: sum(m["at_peak"][p] for m in mems) for p in PARTS}
    r["at_peak"]["activations"] += extra
    top = max(mems, key=lambda m: m["peak"])
    r["peak_at"] = top["peak_at"] + (f" (stage {mine[mems.index(top)]})" if len(mine) > 1 else "")
    r["batch"], r["traced"] = top["batch"], top["traced"]
    r.update(pp_rank=rank, position=position, stages=[
        dict(index=i, in_flight=pipe["stages"][i]["in_flight"],
             activations_per_microbatch=acts[i], peak_traced=per_stage[i]["peak"])
        for i in mine])
    return r


def p2p_per_rank(split: PipelineSplit, m: int, nbytes: int) -> list[dict[str, Any]]:
    """Per pp rank and step: the activations it sends forward and receives (one per
    micro-batch at each stage boundary it sits on), the gradients it sends and receives
    back; a boundary between two stages of one rank (the V schedules' turn) moves nothing."""
    last = len(split.stages) - 1
    rank_of = {s.index: s.rank for s in split.stages}
    out = []
    for rank in range(split.pp):
        c = dict(send_forward=0, recv_forward=0, send_backward=0, recv_backward=0)
        for s in split.of_rank(rank):
            if s.index < last and rank_of[s.index + 1] != rank:
                c["send_forward"] += m
                c["recv_backward"] += m
            if s.index > 0 and rank_of[s.index - 1] != rank:
                c["recv_forward"] += m
                c["send_backward"] += m
        out.append(dict(pp_rank=rank, **c, bytes_each=nbytes))
    return out
