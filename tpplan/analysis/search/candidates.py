"""The layouts ``tpplan search`` tries: every mesh of the world size and every option the
plan leaves open, each written as the ``--set`` overrides that turn the plan into it.

Pure arithmetic on the plan's spec: nothing here checks a candidate (the search does, with
the same checks as ``validate``). What is enumerated:

- the mesh: every ordered factorization ``pp × dp_replicate × dp_shard × cp × tp`` of the
  world size, ``tp`` at most ``max_tp`` (by default the GPUs of one node: tensor
  parallelism's collectives sit on the critical path and want NVLink). ``cp`` (context
  parallelism) above 1 only where the plan asks for it: a ``context_parallel`` section, a
  ``mesh.cp`` of its own, or a sequence of at least :data:`LONG_SEQUENCE` tokens;
- expert parallelism: where the plan has an ``expert_parallel`` rule, each ``ep`` dividing
  ``dp_shard`` (the ranks it borrows);
- activation checkpointing: none, full, and selective every ``k`` for each ``k`` asked;
  per-operator (``op``) where a layout does not fit without (:func:`op_twin`, added by the
  search once that layout's memory is known, with ``Options.op``);
- without a pipeline: each micro-batch size that divides a data-parallel rank's share of
  the global batch (the rest is gradient accumulation);
- with one (``pp > 1``): each schedule of :data:`tpplan.plan.pipeline.SCHEDULES`, with one
  stage per rank or each ``stages_per_rank`` asked where the schedule holds several, and
  each number of micro-batches that divides the rank's share (the micro-batch follows).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...plan.pipeline import SCHEDULES
from ...plan.specs import DEFAULT_BLOCKS, PlanSpec
from ...plan.styles import EP_STYLES

__all__ = ["Candidate", "Options", "candidates", "divisors", "factorizations", "meshes",
           "LONG_SEQUENCE", "ac_settings", "op_twin"]

# From this many tokens a sequence is long: search tries context parallelism unasked.
LONG_SEQUENCE = 32768


@dataclass(frozen=True)
class Options:
    """What the search varies beyond the mesh; the defaults are what ``search`` uses."""

    max_tp: int = 8  # tp at most this (the GPUs of one node by default)
    ac_every: tuple[int, ...] = (2,)  # selective checkpointing periods tried
    stages_per_rank: tuple[int, ...] = (2,)  # for schedules that hold several stages per rank
    schedules: tuple[str, ...] = tuple(SCHEDULES)
    cp: tuple[int, ...] | None = None  # cp degrees tried; None: every divisor, where cp applies
    ep: tuple[int, ...] | None = None  # ep degrees tried; None: every divisor of dp_shard
    op: bool = True  # per-operator checkpointing tried where a layout does not fit without


@dataclass
class Candidate:
    """One layout: its mesh degrees and the ``--set`` lines that turn the plan into it."""

    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    sets: list[str] = field(default_factory=list)
    cp: int = 1
    ep: int = 1

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


def meshes(world_size: int, max_tp: int, cps: tuple[int, ...] = (1,)
           ) -> list[tuple[int, int, int, int, int]]:
    """Every ``(pp, dp_replicate, dp_shard, cp, tp)`` whose product is ``world_size``, with
    ``tp <= max_tp`` and ``cp`` one of ``cps``."""
    return [(pp, r, s // cp, cp, tp) for pp, r, s, tp in factorizations(world_size, max_tp)
            for cp in cps if s % cp == 0]


def _cp_degrees(spec: PlanSpec, world_size: int, options: "Options") -> tuple[int, ...]:
    if options.cp is not None:
        return tuple(sorted(set(options.cp) | {1}))
    asked = (spec.context_parallel.loc is not None or spec.mesh.cp > 1
             or spec.train.seq_len >= LONG_SEQUENCE)
    return tuple(divisors(world_size)) if asked else (1,)


def _ep_degrees(spec: PlanSpec, dp_shard: int, options: "Options") -> list[int]:
    if not any(r.style.name in EP_STYLES for r in spec.rules):
        return [1]
    return [e for e in divisors(dp_shard) if options.ep is None or e in options.ep or e == 1]


def ac_settings(spec: PlanSpec, every: tuple[int, ...], model_blocks: str | None = None
                ) -> list[str]:
    """The checkpointing choices as ``--set`` lines, keeping the plan's ``blocks`` pattern;
    where the plan leaves it at its default, the model's own blocks (``model_blocks``, the
    pattern of :func:`tpplan.models.introspect.find_blocks`: ``model.layers.*`` in HF)."""
    blocks = spec.activation_checkpointing.blocks
    if blocks == DEFAULT_BLOCKS and model_blocks:
        blocks = model_blocks
    extra = "" if blocks == DEFAULT_BLOCKS else f", blocks: '{blocks}'"
    out = ["activation_checkpointing={mode: none}", f"activation_checkpointing={{mode: full{extra}}}"]
    out += [f"activation_checkpointing={{mode: selective, every: {k}{extra}}}"
            for k in every if k > 1]
    return out


def op_twin(c: Candidate, acs: list[str]) -> Candidate | None:
    """``c`` with per-operator checkpointing (``op``) in place of none, for a layout ``c``
    without checkpointing that does not fit (``acs``: :func:`ac_settings`, its ``full`` line
    giving the blocks); None for any other. Only there: where a layout fits without
    checkpointing, ``op`` is never faster (it adds recomputation and saves only memory)."""
    if c.sets[1] != acs[0]:
        return None
    return Candidate(c.pp, c.dp_replicate, c.dp_shard, c.tp,
                     [c.sets[0], acs[1].replace("mode: full", "mode: op"), *c.sets[2:]], c.cp, c.ep)


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


def candidates(spec: PlanSpec, world_size: int, options: Options = Options(),
               model_blocks: str | None = None) -> list[Candidate]:
    """Every candidate layout of ``spec`` at ``world_size``. A data-parallel degree that
    does not divide the global batch still gives one candidate per mesh (the step's check
    drops it with its reason); the micro-batch and pipeline choices need the division. So
    does a mesh whose degrees do not compose yet (``mesh.ep`` refuses ep beside pp or cp,
    ``mesh.cp`` cp beside pp): one candidate, dropped with that reason."""
    out = []
    batch = spec.train.global_batch_size
    acs = ac_settings(spec, options.ac_every, model_blocks)
    for pp, r, s, cp, tp in meshes(world_size, options.max_tp,
                                   _cp_degrees(spec, world_size, options)):
        for ep in _ep_degrees(spec, s, options):
            inner = (f"cp: {cp}, " if cp > 1 or spec.mesh.cp > 1 else "") + \
                (f"ep: {ep}, " if ep > 1 or spec.mesh.ep > 1 else "")
            mesh = f"mesh={{pp: {pp}, dp_replicate: {r}, dp_shard: {s}, {inner}tp: {tp}}}"
            dp = r * s
            if batch % dp or (ep > 1 and (pp > 1 or cp > 1)) or (cp > 1 and pp > 1):
                out.append(Candidate(pp, r, s, tp, [mesh], cp, ep))
                continue
            per_rank = batch // dp
            if pp == 1:
                tail = ["pipeline=null"] if spec.pipeline is not None else []
                micro = [tail + [f"train.micro_batch_size={b}"] for b in divisors(per_rank)]
            else:
                tail = ["train.micro_batch_size=null"] if spec.train.micro_batch_size else []
                micro = [[p] + tail for p in _pipelines(per_rank, pp, options)]
            out += [Candidate(pp, r, s, tp, [mesh, ac, *m], cp, ep) for ac in acs for m in micro]
    return out
