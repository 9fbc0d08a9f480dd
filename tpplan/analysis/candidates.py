"""The layouts ``tpplan search`` tries: every mesh of the world size and every option the
plan leaves open, each written as the ``--set`` overrides that turn the plan into it.

Pure arithmetic on the plan's spec: nothing here checks a candidate (the search does, with
the same checks as ``validate``). What is enumerated:

- the mesh: every ordered factorization ``pp × dp_replicate × dp_shard × tp`` of the world
  size, ``tp`` at most ``max_tp`` (by default the GPUs of one node: tensor parallelism's
  collectives sit on the critical path and want NVLink);
- activation checkpointing: none, full, and selective every ``k`` for each ``k`` asked;
- without a pipeline: each micro-batch size that divides a data-parallel rank's share of
  the global batch (the rest is gradient accumulation);
- with one (``pp > 1``): each schedule of :data:`tpplan.plan.pipeline.SCHEDULES`, with one
  stage per rank or each ``stages_per_rank`` asked where the schedule holds several, and
  each number of micro-batches that divides the rank's share (the micro-batch follows).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..plan.pipeline import SCHEDULES
from ..plan.specs import DEFAULT_BLOCKS, PlanSpec

__all__ = ["Candidate", "Options", "candidates", "divisors", "factorizations"]


@dataclass(frozen=True)
class Options:
    """What the search varies beyond the mesh; the defaults are what ``search`` uses."""

    max_tp: int = 8  # tp at most this (the GPUs of one node by default)
    ac_every: tuple[int, ...] = (2,)  # selective checkpointing periods tried
    stages_per_rank: tuple[int, ...] = (2,)  # for schedules that hold several stages per rank
    schedules: tuple[str, ...] = tuple(SCHEDULES)


@dataclass
class Candidate:
    """One layout: its mesh degrees and the ``--set`` lines that turn the plan into it."""

    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    sets: list[str] = field(default_factory=list)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` (at least 1), ascending."""
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def factorizations(world_size: int, max_tp: int) -> list[tuple[int, int, int, int]]:
    """Every ``(pp, dp_replicate, dp_shard, tp)`` whose product is ``world_size``, with
    ``tp <= max_tp``; tp, then pp, then dp_replicate ascending."""
    out = []
    for tp in divisors(world_size):
        if tp > max_tp:
            continue
        for pp in divisors(world_size // tp):
            rest = world_size // (tp * pp)
            out += [(pp, r, rest // r, tp) for r in divisors(rest)]
    return out


def ac_settings(spec: PlanSpec, every: tuple[int, ...]) -> list[str]:
    """The checkpointing choices as ``--set`` lines, keeping the plan's ``blocks`` pattern."""
    blocks = spec.activation_checkpointing.blocks
    extra = "" if blocks == DEFAULT_BLOCKS else f", blocks: '{blocks}'"
    out = ["activation_checkpointing={mode: none}", f"activation_checkpointing={{mode: full{extra}}}"]
    out += [f"activation_checkpointing={{mode: selective, every: {k}{extra}}}"
            for k in every if k > 1]
    return out


def _pipelines(per_rank: int, pp: int, options: Options) -> list[str]:
    out = []
    for name in options.schedules:
        s = SCHEDULES[name]
        per = [1] if not s.multi else [2] if s.exactly_two else \
            [v for v in options.stages_per_rank if v >= 2]
        for v in per:
            for m in divisors(per_rank):
                sets = f"schedule: {name}, microbatches: {m}"
                if s.multi:
                    sets += f", stages_per_rank: {v}"
                out.append(f"pipeline={{{sets}}}")
    return out


def candidates(spec: PlanSpec, world_size: int, options: Options = Options()) -> list[Candidate]:
    """Every candidate layout of ``spec`` at ``world_size``. A data-parallel degree that
    does not divide the global batch still gives one candidate per mesh (the step's check
    drops it with its reason); the micro-batch and pipeline choices need the division."""
    out = []
    batch = spec.train.global_batch_size
    acs = ac_settings(spec, options.ac_every)
    for pp, r, s, tp in factorizations(world_size, options.max_tp):
        mesh = f"mesh={{pp: {pp}, dp_replicate: {r}, dp_shard: {s}, tp: {tp}}}"
        dp = r * s
        if batch % dp:
            out.append(Candidate(pp, r, s, tp, [mesh]))
            continue
        per_rank = batch // dp
        if pp == 1:
            tail = ["pipeline=null"] if spec.pipeline is not None else []
            micro = [tail + [f"train.micro_batch_size={b}"] for b in divisors(per_rank)]
        else:
            tail = ["train.micro_batch_size=null"] if spec.train.micro_batch_size else []
            micro = [[p] + tail for p in _pipelines(per_rank, pp, options)]
        out += [Candidate(pp, r, s, tp, [mesh, ac, *m]) for ac in acs for m in micro]
    return out
