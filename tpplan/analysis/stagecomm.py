"""Communication of a pipeline plan per pp rank and optimizer step: what each rank issues
for its own stage(s), not for the whole model.

Each stage is cut from the meta model as the runtime cuts it (:func:`tpplan.parallel.
pipeline.stage_module`, the plan resolved on it with ``stage=True``). **TP**: one micro-batch
of the stage traced on meta (:func:`tpplan.analysis.tptrace.trace_tp` with the stage's ends:
a received activation in, a gradient of its output back), times the ``m`` micro-batches the
schedule runs, recomputation under checkpointing included as the trace runs it; the
gradient reductions after backward once per step. **FSDP2**: the stage's own units
(:func:`tpplan.parallel.fsdp_units.unit_sizes` of the stage), reduce-scattered once per step
(the schedule's ``perform_reduce_grad``), all-gathered as often as the rank's order makes
FSDP2 gather them (:func:`tpplan.analysis.schedule.fsdp_gathers`). **pp**: the rank's sends
and receives (:func:`tpplan.analysis.stagemem.p2p_per_rank`). docs/dry-run.md, "Pipeline
stages".
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from ..models import build_model
from ..parallel.fsdp_units import ROOT, unit_sizes
from ..parallel.pipeline import split_stages, stage_module
from ..parallel.resolve import resolve
from ..plan.pipeline import SCHEDULES
from .comm import Accumulation, fsdp_collectives, megatron_minimum, rows
from .schedule import fsdp_gathers, fsdp_order
from .stagemem import p2p_per_rank, reported_ranks
from .steptrace import StageIO
from .tptrace import TPTrace, identical_blocks, trace_tp

__all__ = ["pipeline_comm", "StageComm"]


class StageComm:
    """One stage's parts for the communication analysis: its module (parallelized by the
    TP trace), resolution, FSDP units and one micro-batch's TP collectives."""

    def __init__(self, module, res, units, trace: TPTrace):
        self.module, self.res, self.units, self.trace = module, res, units, trace


def _stages(result, dtype: torch.dtype, cache: dict | None = None
            ) -> tuple[Any, dict[int, StageComm], tuple | None]:
    """Every stage's :class:`StageComm` and the activation a stage sends (shape, dtype).
    Stages alike (same ends, extras and number of identical blocks) share one trace.
    ``cache`` (``search``'s, across the candidates of one plan): the split and each stage's
    resolution, keyed by what they read (tp, pp, the stages per rank and their placement,
    checkpointing, data parallelism as the resolution sees it); a stage's TP trace by that,
    its ends, the micro-batch, sequence and dtype; its FSDP units by that and dp_shard; and
    the shallow traces of alike stages without pp, placement and length (:func:`trace_tp`:
    a stage of identical blocks reads only its ends and the rules, which pp does not
    change)."""
    cache = {} if cache is None else cache
    spec, dims, shape, mesh = result.plan.spec, result.resolution.dims, result.step, result.mesh
    ac, pipe = spec.activation_checkpointing, spec.pipeline
    key = (dims.tp, dims.pp, pipe.stages_per_rank, SCHEDULES[pipe.schedule].v_shape, ac.mode,
           ac.every, dims.dp if spec.fsdp is None else dims.dp > 1, dims.cp, dims.ep)
    if key not in cache:
        whole = build_model(spec.model, "meta")
        split = split_stages(whole, spec, dims.pp)
        split.errors.raise_if_any()
        alike = identical_blocks(whole, result.resolution.rule_of) is not None
        parts = []
        for stage in split.stages:
            module = stage_module(whole, stage, split)
            res = resolve(spec, module, dims.world_size, stage=True)
            res.errors.raise_if_any()
            ends = (stage.index == 0, stage.index == len(split.stages) - 1)
            parts.append((stage, module, res, (*ends, tuple(stage.extras), len(stage.blocks))
                          if alike else stage.index))
        cache[key] = (whole, split, parts)
    whole, split, parts = cache[key]
    out: dict[int, StageComm] = {}
    boundary = None
    for stage, module, res, alike in parts:
        io = StageIO(first=stage.index == 0, last=stage.index == len(parts) - 1,
                     received=boundary)
        tkey = (key, alike, shape.seq_len, shape.micro_batch, dtype)
        if tkey not in cache:
            if dims.tp > 1 or dims.ep > 1 or dims.cp > 1:  # TP's, the experts' and cp's
                # Alike stages of any length (any pp) share their shallow traces.
                # (Not dp either: the trace applies TP only, with rules dp does not change.)
                deep = ("shallow", key[0], *key[4:6], *key[7:], alike[:3] if isinstance(alike, tuple)
                        else (key, alike), shape.seq_len, shape.micro_batch, dtype)
                trace = trace_tp(spec, res, mesh, lambda s=stage: stage_module(whole, s, split),
                                 shape.seq_len, shape.micro_batch, dtype, io=io,
                                 shallow=(cache, deep))
            else:
                trace = TPTrace(Counter(), [], None)
                if not io.last:  # no TP: the stage's output is the whole activation
                    io.sent = _output(stage_module(whole, stage, split), io, shape, dtype)
            cache[tkey] = (trace, io.sent)
        trace, sent = cache[tkey]
        boundary = boundary or sent
        ukey = (key, stage.index, dims.dp_shard)
        if ukey not in cache:
            cache[ukey] = unit_sizes(module, res, dims, spec)
        out[stage.index] = StageComm(module, res, cache[ukey], trace)
    return split, out, boundary


def _output(module, io: StageIO, shape, dtype: torch.dtype) -> tuple:
    module.to(dtype)
    x = torch.zeros(shape.micro_batch, shape.seq_len, dtype=torch.long, device="meta") \
        if io.first else torch.zeros(io.received[0], dtype=io.received[1], device="meta")
    with torch.no_grad():
        y = module(x)
    return tuple(y.shape), y.dtype


def pipeline_comm(result, param: torch.dtype, reduce: torch.dtype, step: Accumulation,
                  cache: dict | None = None) -> tuple[dict[str, Any], TPTrace, list]:
    """``(comm_per_step, trace, stages)`` for a pipeline plan: the busiest pp rank's rows
    (the largest wire bytes) under the usual keys, every pp rank's in ``pp_ranks``; the
    busiest rank's TP trace (its stages' collectives of one micro-batch, summed) and its
    :class:`StageComm`\\ s, for the minimum. ``cache``: ``search``'s (:func:`_stages`)."""
    spec, dims, shape = result.plan.spec, result.resolution.dims, result.step
    pipe = spec.pipeline
    m = pipe.microbatches
    split, stages, boundary = _stages(result, param, cache)
    order = fsdp_order(pipe.schedule, dims.pp, pipe.stages_per_rank, m)
    p2p = {}
    if boundary is not None:
        n = 1
        for d in boundary[0]:
            n *= d
        p2p = {r["pp_rank"]: r for r in p2p_per_rank(split, m, n * boundary[1].itemsize)}
    reshard = bool(spec.fsdp and spec.fsdp.reshard_after_forward)
    positions = reported_ranks(dims.pp)
    ranks, traces = [], []
    for rank in range(dims.pp):
        local = split.of_rank(rank)
        counts: Counter = Counter()
        for s in local:
            counts.update(stages[s.index].trace.counts)
        first = stages[local[0].index].trace
        traces.append(TPTrace(counts, first.depths, first.blocks))
        fsdp = []
        for s in local:
            memo: dict[bool, int] = {}  # a unit's gathers depend on whether it reshards only

            def gathers(unit: str, index: int = s.index, acts: list = order[rank],
                        memo: dict = memo) -> int:
                again = reshard and unit != ROOT
                if again not in memo:
                    memo[again] = fsdp_gathers(acts, index, again)
                return memo[again]
            fsdp += fsdp_collectives(stages[s.index].units, spec.fsdp, shape, dims,
                                     param.itemsize, reduce.itemsize, gathers)
        collectives = rows(traces[-1], fsdp, step, dims) + _p2p_rows(p2p.get(rank))
        ranks.append(dict(pp_rank=rank, position=positions.get(rank),
                          stages=[s.index for s in local], collectives=collectives,
                          wire_bytes=sum(c["wire_bytes"] for c in collectives)))
    busiest = max(ranks, key=lambda r: r["wire_bytes"])
    mine = [stages[i] for i in busiest["stages"]]
    return dict(pp_rank=busiest["pp_rank"], stages=busiest["stages"],
                collectives=busiest["collectives"], pp_ranks=ranks), \
        traces[busiest["pp_rank"]], mine


def _p2p_rows(r: dict[str, Any] | None) -> list[dict[str, Any]]:
    """A rank's sends and receives as rows of the table (wire bytes: what it sends)."""
    out = []
    for kind in ("send", "recv") if r else ():
        k = r[f"{kind}_forward"] + r[f"{kind}_backward"]
        b = k * r["bytes_each"]
        out.append(dict(source="pp", kind=kind, mesh_dim="pp", count=k, bytes=b,
                        wire_bytes=b if kind == "send" else 0))
    return out


def stage_minimum(stages: list[StageComm], spec, shape, e: int, e_grad: int) -> tuple[Counter, Counter]:
    """The Megatron minimum of a rank's stages, summed (:func:`megatron_minimum` on each)."""
    counts: Counter = Counter()
    nbytes: Counter = Counter()
    for s in stages:
        c, b = megatron_minimum(s.module, s.res, spec, shape, e, e_grad)
        counts.update(c)
        nbytes.update(b)
    return counts, nbytes
