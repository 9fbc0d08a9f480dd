"""The ``pipeline:`` section: which ``torch.distributed.pipelining`` schedule runs the ``pp``
stages, with how many micro-batches, how many stages each rank holds, and where they split.

Checked here, without the model: the schedule's name, ``stages_per_rank`` against what the
schedule can run, ``microbatches`` against the schedule's own checks (the ones torch's
constructors raise, made located errors), the number of explicit split points, and that
``mesh.pp`` and the section come together. Whether the split points name modules of the
model, in order, is :func:`tpplan.parallel.pipeline.split.split_stages`' check; whether the batch
splits into the micro-batches is the step's (:func:`tpplan.plan.step.step_shape`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ErrorList, nearest
from .reader import Reader
from .specs import MeshSpec, PipelineSpec
from .yamlio import LMap, LSeq

__all__ = ["SCHEDULES", "Schedule", "check_microbatches", "parse_pipeline", "split_reads"]


@dataclass(frozen=True)
class Schedule:
    """One schedule under its plan name: the torch class, and what its constructor checks."""

    torch_class: str  # in torch.distributed.pipelining.schedules
    multi: bool  # holds several (virtual) stages per rank: stages_per_rank >= 2
    v_shape: bool = False  # rank r holds stages r and 2·pp-1-r (else r, r+pp, r+2pp, ...)
    exactly_two: bool = False  # stages_per_rank must be 2
    needs_all_stages: bool = False  # microbatches >= number of stages
    rounds: bool = False  # microbatches a multiple of max(1, microbatches // pp)
    no_compile: bool = False  # splits backward into input and weight parts: no torch.compile


SCHEDULES: dict[str, Schedule] = {
    "gpipe": Schedule("ScheduleGPipe", multi=False),
    "1f1b": Schedule("Schedule1F1B", multi=False, needs_all_stages=True),
    "interleaved_1f1b": Schedule("ScheduleInterleaved1F1B", multi=True, rounds=True),
    "looped_bfs": Schedule("ScheduleLoopedBFS", multi=True),
    "interleaved_zero_bubble": Schedule("ScheduleInterleavedZeroBubble", multi=True, rounds=True,
                                        no_compile=True),
    "zbv": Schedule("ScheduleZBVZeroBubble", multi=True, v_shape=True, exactly_two=True,
                    no_compile=True),
    "dualpipev": Schedule("ScheduleDualPipeV", multi=True, v_shape=True, exactly_two=True,
                          needs_all_stages=True, no_compile=True),
}


def check_microbatches(name: str, microbatches: int, pp: int, stages: int) -> str | None:
    """Why ``microbatches`` cannot run schedule ``name`` on ``pp`` ranks holding ``stages``
    stages in all (torch's own constructor checks), or None."""
    s = SCHEDULES[name]
    if s.needs_all_stages and microbatches < stages:
        return (f"schedule {name} needs at least as many micro-batches as stages "
                f"({stages}), got microbatches={microbatches}")
    if s.rounds:
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            return (f"schedule {name} runs microbatches // pp = {rounds} rounds of equal size, "
                    f"so microbatches must be a multiple of {rounds}, got {microbatches} "
                    f"(e.g. {microbatches // pp * pp} or {(microbatches // pp + 1) * pp})")
    return None


def split_reads(pipe: PipelineSpec, pp: int) -> tuple:
    """What the stage split (``parallel.pipeline.split_stages``) reads of a plan's pipeline
    section at ``pp`` ranks, as a key: the stages per rank, whether the schedule lays them
    out in a V, and the split points. Not the schedule's number of micro-batches."""
    split = pipe.split if isinstance(pipe.split, str) else tuple(pipe.split)
    return pp, pipe.stages_per_rank, SCHEDULES[pipe.schedule].v_shape, split


def parse_pipeline(doc: LMap, mesh: MeshSpec, compiled: bool, errs: ErrorList) -> PipelineSpec | None:
    """The section, or None without one; ``mesh.pp`` and the section must come together."""
    pp_loc = mesh.locs.get("pp", mesh.loc)
    if doc.get("pipeline") is None:
        if mesh.pp > 1:
            errs.add(f"mesh.pp={mesh.pp} splits the model into pipeline stages, but the plan has "
                     "no 'pipeline' section to say how; add e.g. 'pipeline: {schedule: 1f1b, "
                     "microbatches: 8, split: auto}'", pp_loc)
        return None
    r = Reader(errs, "pipeline", doc["pipeline"], doc.value_loc("pipeline"),
               ("schedule", "microbatches", "stages_per_rank", "split"))
    spec = PipelineSpec(schedule=r.get("schedule", str, "1f1b"),
                        microbatches=r.get("microbatches", int, None),
                        stages_per_rank=r.get("stages_per_rank", int, None),
                        loc=doc.key_loc("pipeline"), locs=r.locs())
    if mesh.pp == 1:
        errs.add("the plan has a 'pipeline' section but mesh.pp is 1 (no pipeline); set mesh.pp "
                 "to the number of pipeline ranks, or remove the section (--set pipeline=null)",
                 spec.loc)
    sched = SCHEDULES.get(spec.schedule)
    if sched is None:
        errs.add(f"unknown pipeline schedule '{spec.schedule}'{nearest(spec.schedule, SCHEDULES)}; "
                 f"expected one of: {', '.join(SCHEDULES)}", r.loc("schedule"))
        spec.schedule = "1f1b"
        sched = SCHEDULES["1f1b"]
    if spec.stages_per_rank is None:
        spec.stages_per_rank = 2 if sched.multi else 1
    elif spec.stages_per_rank < 1:
        errs.add(f"'pipeline.stages_per_rank' must be at least 1, got {spec.stages_per_rank}",
                 r.loc("stages_per_rank"))
        spec.stages_per_rank = 1
    elif sched.multi and spec.stages_per_rank < 2:
        errs.add(f"schedule {spec.schedule} interleaves several stages on each rank: "
                 f"stages_per_rank must be at least 2, got 1 (or use gpipe or 1f1b for one stage "
                 f"per rank)", r.loc("stages_per_rank"))
    elif not sched.multi and spec.stages_per_rank != 1:
        errs.add(f"schedule {spec.schedule} runs one stage per rank, got stages_per_rank="
                 f"{spec.stages_per_rank} (for virtual stages use interleaved_1f1b, looped_bfs or "
                 f"interleaved_zero_bubble)", r.loc("stages_per_rank"))
    elif sched.exactly_two and spec.stages_per_rank != 2:
        errs.add(f"schedule {spec.schedule} places exactly 2 stages on each rank (a V), got "
                 f"stages_per_rank={spec.stages_per_rank}", r.loc("stages_per_rank"))
    stages = mesh.pp * spec.stages_per_rank
    if spec.microbatches is None:
        spec.microbatches = max(stages, 1)
    elif spec.microbatches < 1:
        errs.add(f"'pipeline.microbatches' must be at least 1, got {spec.microbatches}",
                 r.loc("microbatches"))
        spec.microbatches = max(stages, 1)
    elif mesh.pp > 1 and (why := check_microbatches(spec.schedule, spec.microbatches, mesh.pp,
                                                    stages)):
        errs.add(why, r.loc("microbatches"))
    if compiled and sched.no_compile:
        errs.add(f"schedule {spec.schedule} splits each backward into input and weight parts, "
                 "which torch.compile'd blocks do not support; turn compile off or use "
                 "interleaved_1f1b", r.loc("schedule"))
    _parse_split(r, spec, stages)
    return spec


def _parse_split(r: Reader, spec: PipelineSpec, stages: int) -> None:
    value = r.m.get("split", "auto")
    if value == "auto":
        spec.split = "auto"
        return
    if not isinstance(value, LSeq) or not all(isinstance(v, str) for v in value):
        r.errs.add(f"'pipeline.split' is 'auto' or a list of the module paths where stages 2, "
                   f"3, ... start (e.g. [layers.8, layers.16]), got {value!r}", r.loc("split"))
        return
    spec.split = [str(v) for v in value]
    spec.split_locs = [value.item_loc(i) for i in range(len(value))]
    if stages > 1 and len(value) != stages - 1:
        r.errs.add(f"'pipeline.split' names where stages 2.. start: {stages} stages (mesh.pp × "
                   f"stages_per_rank) need {stages - 1} split points, got {len(value)}",
                   r.loc("split"))
