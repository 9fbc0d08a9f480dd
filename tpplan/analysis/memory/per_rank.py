"""Memory per rank: the trainer's step run on fake tensors, its storages followed by part.

Nothing here is a formula. :func:`tpplan.analysis.memory.step.trace_step` runs one optimizer
step of the plan (TP, activation checkpointing, FSDP2, gradient accumulation with sync off
until the last micro-batch, AdamW) on fake tensors at the plan's world size, and
:class:`~tpplan.analysis.memory.tracker.MemoryTracker` follows every storage the step holds.

Deep models (more than 15k blocks; 6k where ``search``'s cache holds those three traces of
an alike model already) are traced at depths 4k, 5k and 6k of their identical repeated
blocks (k = 1, or the period of selective checkpointing). Every labelled moment (in
one of the first or last 2k blocks, in a module outside the blocks, a mark) is then affine
in depth, and is extrapolated to the model's depth when the three traces show it is (the
same check as the TP trace); otherwise every block is traced. Moments in the blocks between
are left out: there, where every neighbour is a block, a moment is linear in the block's
index (per residue of k), so it is largest at the ends of that stretch, which are labelled.
docs/dry-run.md explains each part.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.nn as nn

from ...plan.specs import PlanSpec
from ...plan.step import StepShape
from ...parallel.lora.sizes import same_in_every_block
from .tracker import PARTS, Moment
from .step import (StageIO, first_forward_ends, forward_activations,
                        micro_batches_traced, trace_step)

__all__ = ["memory_per_rank", "first_forward", "first_depths", "extrapolate",
           "describe_moment", "shallow_depths", "kept_traces", "period_depths"]


def _numbers(m: Moment) -> dict[str, int]:
    out = {"total": m.total}
    out.update({f"at:{p}": v for p, v in m.parts.items()})
    out.update({f"max:{p}": v for p, v in m.part_max.items()})
    return out


def _moment(numbers: dict[str, int]) -> Moment:
    m = Moment()
    m.total = numbers["total"]
    m.parts = {k[3:]: v for k, v in numbers.items() if k.startswith("at:")}
    m.part_max = {k[4:]: v for k, v in numbers.items() if k.startswith("max:")}
    return m


def extrapolate(traces: list[dict[str, Moment]], depths: list[int], depth: int,
                blocks: str) -> dict[str, Moment] | None:
    """Moments at ``depth`` from moments at three equally spaced ``depths``; None when a
    moment is not affine in depth (or not found at every depth)."""
    middle = f"{blocks}.middle"
    kept = [{k: _numbers(m) for k, m in t.items() if middle not in k} for t in traces]
    if not (kept[0].keys() == kept[1].keys() == kept[2].keys()):
        return None
    step = depths[1] - depths[0]
    out = {}
    for label, v1 in kept[0].items():
        v2, v3 = kept[1][label], kept[2][label]
        if v1.keys() != v2.keys() or v2.keys() != v3.keys():
            return None
        numbers = {}
        for key, a in v1.items():
            d = v2[key] - a
            if v3[key] - v2[key] != d:
                return None
            numbers[key] = a + (depth - depths[0]) // step * d
        out[label] = _moment(numbers)
    return out


def describe_moment(label: str, blocks: str | None = None, n_blocks: int = 0) -> str:
    """``last/backward/layers.tail0`` -> ``backward of layers.31, last micro-batch``: the
    moment in words, a block's place turned back into its index."""
    stage, _, rest = label.partition("/")
    if rest == "":
        return {"optimizer": "the optimizer step", "setup": "the start of the step"}.get(stage, stage)
    what, _, where = rest.partition("/")
    micro = {"only": "", "first": ", first micro-batch", "middle": ", a middle micro-batch",
             "last": ", last micro-batch"}.get(stage, f", {stage}")
    if what == "mark":
        return {"end_forward": "end of forward", "end_backward": "end of backward"}[where] + micro
    if blocks and where.startswith(blocks + "."):
        place, _, sub = where[len(blocks) + 1:].partition(".")
        if place.startswith("head") and place[4:].isdigit():
            place = place[4:]
        elif place.startswith("tail") and place[4:].isdigit():
            place = str(n_blocks - 1 - int(place[4:]))
        where = f"{blocks}.{place}" + (f".{sub}" if sub else "")
    return f"{what} of {where}{micro}"


def kept_traces(shallow: tuple[dict, object] | None, io: StageIO | None,
                run: Callable[[], list]) -> list:
    """``run()``'s shallow traces, kept under ``shallow = (cache, key)`` when given (with the
    activation they left in ``io.sent``, which a later call gets back in its own ``io``)."""
    memo, key = shallow or ({}, None)
    if key not in memo:
        memo[key] = (run(), io and io.sent)
    traces, sent = memo[key]
    if io is not None:
        io.sent = sent
    return traces


def period_depths(n_blocks: int, k: int, first: int = 1) -> list[int]:
    """Three depths a period ``k`` apart for a model of ``n_blocks`` blocks: ``first``,
    ``first + 1`` and ``first + 2`` periods, or, where k leaves a remainder r, r on top of
    one period fewer each (every shallow model ends as the model does)."""
    r = n_blocks % k
    start = r + (first - 1) * k if r else first * k
    return [start, start + k, start + 2 * k]


def shallow_depths(spec: PlanSpec, n_blocks: int, blocks: str | None, cut: bool = True,
                   kept: bool = False) -> list[int] | None:
    """The depths of the three shallow traces for a model of ``n_blocks`` blocks, 4k, 5k
    and 6k (k: 1, or selective checkpointing's period, where it divides the depth), or None
    when it is traced whole (three shallow traces cost 15k blocks: deeper models pay; with
    ``kept``, the three are cached already and every model of 6k blocks or more takes them:
    the extrapolation is the same arithmetic)."""
    k = spec.activation_checkpointing.every
    depths = period_depths(n_blocks, k, 4)
    least = depths[-1] if kept else 15 * k + 1
    return depths if cut and blocks is not None and not n_blocks % k and n_blocks >= least \
        else None


def _kept(shallow: tuple[dict, object] | None) -> bool:
    """Whether ``shallow = (cache, key)`` holds its traces already."""
    return shallow is not None and shallow[1] in shallow[0]


def _step(spec: PlanSpec, mesh, build: Callable[[], nn.Module], shape: StepShape,
          depth: int | None, io: StageIO | None, scaled: tuple | None) -> dict[str, Moment]:
    """:func:`trace_step`'s moments; with ``scaled = (cache, key, dp_shard)``, those of a
    step traced at another dp_shard under ``key`` where they scale exactly
    (:meth:`~tpplan.analysis.memory.dp_shards.ScaledTrace.at`), else traced and kept there (counted
    in ``cache["counts"]``: ``memory_dp_scaled``, ``memory_steps``)."""
    if scaled is None:
        return trace_step(spec, mesh, build, shape, depth, io)
    cache, key, dp_shard = scaled
    kept = cache.setdefault((key, depth), [])
    for trace in kept:
        moments = trace.at(dp_shard)
        if moments is not None:
            if io is not None:
                io.sent = trace.sent
            cache["counts"]["memory_dp_scaled"] += 1
            return moments
    cache["counts"]["memory_steps"] += 1
    kept.append(trace_step(spec, mesh, build, shape, depth, io, scalable=True))
    return kept[-1].moments


def _trace(spec: PlanSpec, mesh, build: Callable[[], nn.Module], shape: StepShape,
           n_blocks: int, blocks: str | None, cut: bool, io: StageIO | None,
           shallow: tuple[dict, object] | None, scaled: tuple | None,
           ) -> tuple[dict[str, Moment], list[int]]:
    depths = shallow_depths(spec, n_blocks, blocks, cut, _kept(shallow))
    if depths and same_in_every_block(spec, build):  # else the first blocks tell not all
        traces = kept_traces(shallow, io, lambda: [
            _step(spec, mesh, build, shape, d, io, scaled) for d in depths])
        moments = extrapolate(traces, depths, n_blocks, blocks)
        if moments is not None:
            return moments, depths
    return _step(spec, mesh, build, shape, None, io, scaled), []


def first_forward(spec: PlanSpec, mesh, build: Callable[[], nn.Module], shape: StepShape,
                  n_blocks: int, blocks: str | None, cut: bool = True,
                  io: StageIO | None = None, shallow: tuple[dict, object] | None = None,
                  ) -> int:
    """The activations the step holds at the end of its first micro-batch's forward (bytes):
    what one forward saves for backward, with its logits and loss. Only that forward runs
    (:func:`trace_step` with ``first_forward``). A model of at least 4k identical blocks
    (k = 1, or the period of selective checkpointing; r + 4k where k leaves a remainder r,
    its checkpointed blocks at the same places from the first) runs once at
    :func:`first_depths`' depth, and the activations live at the end of each of its first
    four periods are read: where the third and fourth add the same bytes (what each saves,
    its output, less the output of the block two before it, freed once the next has run; the
    first two may differ, the stage's input lives on), so does every period a deeper model
    has in between, and the figure is extrapolated; else every block is run. Arguments as
    :func:`memory_per_rank`'s (``shallow`` keeps that run for any depth)."""
    depths = first_depths(spec, n_blocks, blocks, cut)
    if depths and same_in_every_block(spec, build):
        k = spec.activation_checkpointing.every
        total, ends = kept_traces(shallow, io, lambda: first_forward_ends(
            spec, mesh, build, shape, depths[0], k, io))
        if ends[2] - ends[1] == ends[3] - ends[2]:
            return total + (n_blocks - depths[0]) // k * (ends[3] - ends[2])
    return forward_activations(trace_step(spec, mesh, build, shape, None, io,
                                          first_forward=True))


def first_depths(spec: PlanSpec, n_blocks: int, blocks: str | None, cut: bool = True
                 ) -> list[int] | None:
    """:func:`first_forward`'s one depth (a list of it): r + 4k, where k leaves a remainder
    r; None where it runs every block (a model of fewer blocks: a model as deep runs no
    more than the one run, and takes the one a cache keeps for an alike model)."""
    k = spec.activation_checkpointing.every
    depth = n_blocks % k + 4 * k
    return [depth] if cut and blocks is not None and n_blocks >= depth else None


def memory_per_rank(spec: PlanSpec, mesh, build: Callable[[], nn.Module], shape: StepShape,
                    n_blocks: int, blocks: str | None, cut: bool = True,
                    io: StageIO | None = None, shallow: tuple[dict, object] | None = None,
                    scaled: tuple[dict, object, int] | None = None) -> dict[str, Any]:
    """Bytes per rank by part, each at its own largest, their ``total``, and the ``peak``
    of the step with its split by part (``at_peak``) and when it happens (``peak_at``).

    ``blocks``: the path of identical repeated blocks (``n_blocks`` of them), or None;
    ``cut=False`` traces every block even when three shallow traces would do; ``io``:
    ``build`` makes one pipeline stage (:mod:`tpplan.analysis.memory.stages`); ``shallow``:
    ``(cache, key)``, the three shallow traces kept under ``key``, which the caller makes
    of everything they read (``search``: models or stages that differ only in depth);
    ``scaled``: ``(cache, key, dp_shard)``, each step traced kept under ``key`` (everything
    it reads but dp_shard) and served at any other dp_shard where that is exact
    (:mod:`tpplan.analysis.memory.dp_shards`)."""
    moments, depths = _trace(spec, mesh, build, shape, n_blocks, blocks, cut, io, shallow,
                             scaled)
    label, top = max(moments.items(), key=lambda kv: kv[1].total)
    out: dict[str, Any] = {p: max(m.part_max.get(p, 0) for m in moments.values()) for p in PARTS}
    # Activations: what forward leaves for backward (its temporaries are gone by then).
    out["activations"] = max(m.parts["activations"] for k, m in moments.items()
                             if k.endswith("/mark/end_forward"))
    out["total"] = sum(out[p] for p in PARTS)
    out["peak"] = top.total
    out["at_peak"] = {p: top.parts.get(p, 0) for p in PARTS}
    out["peak_at"] = describe_moment(label, blocks, n_blocks)
    out["batch"] = dict(seq_len=shape.seq_len, micro_batch_size=shape.micro_batch,
                        grad_accum=shape.grad_accum, compute_dtype=shape.param_dtype)
    out["traced"] = dict(depths=depths, blocks=blocks if depths else None,
                         micro_batches=micro_batches_traced(shape.grad_accum))
    return out
