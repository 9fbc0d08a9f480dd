"""Communication of a pipeline plan per pp rank and optimizer step: what each rank issues
for its own stage(s), not for the whole model.

Each stage is cut from the meta model as the runtime cuts it (:func:`tpplan.parallel.
pipeline.stage_module`, the plan resolved on it with ``stage=True``). **TP**: one micro-batch
of the stage traced on meta (:func:`tpplan.analysis.comm.tp_trace.trace_tp` with the stage's ends:
a received activation in, a gradient of its output back), times the ``m`` micro-batches the
schedule runs, recomputation under checkpointing included as the trace runs it; the
gradient reductions after backward once per step. **FSDP2**: the stage's own units
(:func:`tpplan.parallel.fsdp_units.unit_sizes` of the stage), reduce-scattered once per step
(the schedule's ``perform_reduce_grad``), all-gathered as often as the rank's order makes
FSDP2 gather them (:func:`tpplan.analysis.cost.schedule.fsdp_gathers`). **pp**: the rank's sends
and receives (:func:`tpplan.analysis.memory.stages.p2p_per_rank`). docs/dry-run.md, "Pipeline
stages".
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import replace
from typing import Any

import torch

from ...models import build_model
from ...parallel.fsdp_units import ROOT, unit_shapes
from ...parallel.meta_kernel_cache import MetaCacheMode
from ...parallel.lora.sizes import same_in_every_block
from ...parallel.pipeline.split import StageBuilder, stage_module
from ...parallel.resolve import AC_BLOCKS, match_modules, resolve
from ...plan import ErrorList
from ...plan.specs import ACSpec
from .step import Accumulation, fsdp_collectives, megatron_minimum, rows
from ..cost.schedule import fsdp_gathers, fsdp_order
from ..memory.stages import kept_split, p2p_per_rank, reported_ranks
from ..memory.step import StageIO
from .tp_batch import traced_in_batch
from ..search.check_cache import PartCache
from .tp_trace import TPTrace, identical_blocks, trace_tp

__all__ = ["pipeline_comm", "pipeline_fsdp_rows", "StageComm"]


class StageComm:
    """One stage's parts for the communication analysis: its module (parallelized by the
    TP trace), resolution, FSDP units and one micro-batch's TP collectives."""

    def __init__(self, module, res, units, trace: TPTrace):
        self.module, self.res, self.units, self.trace = module, res, units, trace


def _parts(result, cache: dict, units_only: bool = False
           ) -> tuple[Any, Any, tuple, dict[int, tuple]]:
    """``(whole, split, rkey, parts)``: the meta model, its split, the key of what a stage's
    resolution reads, and each stage's ``(module, resolution, FSDP units)`` by index, each
    cached by what it reads (:func:`_stages`); no trace runs. ``units_only``: the module
    and resolution left None where the units are cached already."""
    spec, dims = result.plan.spec, result.resolution.dims
    if "model" not in cache:
        cache["model"] = build_model(spec.model, "meta")
    whole = cache["model"]
    split = kept_split(cache, whole, spec, dims.pp)
    rkey = (dims.tp, dims.dp if spec.fsdp is None else dims.dp > 1, dims.cp, dims.ep,
            dims.ep_borrows_tp)
    parts = {}
    for stage in split.stages:
        shapes = ("unit shapes", rkey, (stage.blocks, stage.extras))  # any dp_shard's
        ukey = (*shapes, dims.dp_shard)
        module = res = None
        if shapes not in cache or not units_only:
            module, res = _resolved(cache, whole, split, stage, spec, dims, rkey)
        if shapes not in cache:
            cache[shapes] = unit_shapes(module, res, dims, spec)
        if ukey not in cache:
            cache[ukey] = cache[shapes].sized(dims)
        parts[stage.index] = (module, res, cache[ukey])
    return whole, split, rkey, parts


def _stages(result, dtype: torch.dtype, cache: dict | None = None
            ) -> tuple[Any, dict[int, StageComm], tuple | None]:
    """Every stage's :class:`StageComm` and the activation a stage sends (shape, dtype).
    ``cache`` (``search``'s, across the candidates of one plan; docs/search.md, "The
    cache"): each part keyed by what it reads. The model, built once (the candidates share
    its section); the split by pp, stages per rank, V placement and split points; a stage's
    module by the blocks and extras it owns; its resolution by those and the degrees
    resolve reads (tp, data parallelism as it sees it, cp, ep), checkpointing's blocks
    matched on the stage afterwards (:func:`_resolved`); its FSDP units' shapes by that
    (:func:`unit_shapes`), their sizes by dp_shard too; its TP trace by what
    :func:`traced_in_batch` says, so that alike stages (same ends, extras and length, where
    the model's blocks are identical) of any pp, stages per rank and schedule share one
    trace, and micro-batches past three share theirs."""
    cache = {} if cache is None else cache
    spec, dims, shape = result.plan.spec, result.resolution.dims, result.step
    ac, cp = spec.activation_checkpointing, spec.context_parallel
    whole, split, rkey, parts = _parts(result, cache)
    if ("alike", rkey) not in cache:  # LoRA or freeze on some blocks only: not alike
        cache["alike", rkey] = identical_blocks(whole, result.resolution.rule_of) is not None \
            and same_in_every_block(spec, whole)
    # What a stage's trace reads besides the stage, its input and the micro-batch: the
    # degrees of the meshes it runs on (not dp: the trace applies TP, cp and ep only),
    # checkpointing, the sequence and the dtype.
    reads = (dims.tp, dims.cp, dims.ep, dims.ep_borrows_tp, cp.method, cp.load_balance,
             ac.mode, ac.every, shape.seq_len, dtype)
    out: dict[int, StageComm] = {}
    boundary = None
    for stage in split.stages:
        own = (stage.blocks, stage.extras)
        module, res, units = parts[stage.index]
        first, last = stage.index == 0, stage.index == len(split.stages) - 1
        # Identical blocks: a stage's collectives read its ends, extras and length only
        # (the module names in a trace's keys are generalized, layers.* for layers.17).
        ends = (first, last, stage.extras, len(stage.blocks)) if cache["alike", rkey] else own

        def run(b: int, received: tuple | None, stage=stage, res=res, ends=ends,
                io=(first, last)):
            return _trace(result, cache, (reads, ends[:3] if cache["alike", rkey] else ends),
                          StageBuilder(whole, stage, split), res, b, dtype,
                          StageIO(*io, received))
        trace, sent = traced_in_batch(cache, (reads, ends), shape.micro_batch, boundary, run,
                                      cache.get("counts"), "stage_tp")
        boundary = boundary or sent
        out[stage.index] = StageComm(module, res, units, trace)
    return split, out, boundary


def _resolved(cache: dict, whole, split, stage, spec, dims, rkey: tuple) -> tuple[Any, Any]:
    """A stage's module and its resolution, with this candidate's degrees and checkpointing
    blocks. The module reads only the blocks and extras the stage owns (not which stage it
    is, pp or the placement), the resolution that module and ``rkey``; resolved without
    checkpointing, whose blocks are matched here by resolve's own :func:`match_modules`
    (all resolve reads of that section), as the search's whole-model resolutions are."""
    own = (stage.blocks, stage.extras)
    if ("module", own) not in cache:
        module = stage_module(whole, stage, split)
        cache["module", own] = (module, dict(module.named_modules()),
                                {n for n, _ in module.named_parameters()})
    module, modules, params = cache["module", own]
    # The module's parts of a resolution, keyed by what each reads (search.check_cache.PartCache):
    # resolutions under other degrees share what does not read them (tp's rule matches).
    parts = cache.setdefault(("parts", own), PartCache())
    key = ("resolution", rkey, own)
    if key not in cache:
        res = resolve(replace(spec, activation_checkpointing=ACSpec()), module,
                      dims.world_size, stage=True, part=parts)
        res.errors.raise_if_any()
        cache[key] = res
        _count(cache, "stage_resolutions")
    res = copy.copy(cache[key])
    res.dims = dims
    ac = spec.activation_checkpointing
    if ac.enabled:
        errs = ErrorList()
        res.ac_blocks = list(parts((AC_BLOCKS, ac.blocks), errs, lambda e: match_modules(
            ac.blocks, AC_BLOCKS, "blocks pattern", ac.loc, modules, params, True, e)))
        errs.raise_if_any()
    return module, res


def _count(cache: dict, what: str) -> None:
    """Counted in the cache's ``counts`` (the search's trace counts), when it has one."""
    if "counts" in cache:
        cache["counts"][what] += 1


def _trace(result, cache: dict, shallow_key: tuple, build, res, micro_batch: int,
           dtype: torch.dtype, io: StageIO) -> tuple[TPTrace, tuple | None]:
    """One stage's TP collectives of one micro-batch of ``micro_batch`` sequences and the
    (shape, dtype) it sends on. A deep stage's shallow trace is kept under
    ``shallow_key`` with the micro-batch and input (:func:`trace_tp`: the trace of identical
    blocks reads only its ends and the rules, not the stage's length, so pp does not
    change them)."""
    spec, dims, shape, mesh = result.plan.spec, result.resolution.dims, result.step, result.mesh
    if dims.tp > 1 or dims.ep > 1 or dims.cp > 1:  # TP's, the experts' and cp's
        deep = ("shallow", shallow_key, io.received, micro_batch)
        trace = trace_tp(spec, res, mesh, build, shape.seq_len, micro_batch, dtype, io=io,
                         shallow=(cache, deep))
    else:
        trace = TPTrace(Counter(), [], None)
        if not io.last:  # no TP: the stage's output is the whole activation
            io.sent = _output(build(), io, micro_batch, shape.seq_len, dtype)
    return trace, io.sent


def _output(module, io: StageIO, micro_batch: int, seq_len: int, dtype: torch.dtype) -> tuple:
    module.to(dtype)
    x = torch.zeros(micro_batch, seq_len, dtype=torch.long, device="meta") \
        if io.first else torch.zeros(io.received[0], dtype=io.received[1], device="meta")
    with torch.no_grad(), MetaCacheMode():
        y = module(x)
    return tuple(y.shape), y.dtype


def pipeline_comm(result, param: torch.dtype, reduce: torch.dtype, step: Accumulation,
                  cache: dict | None = None) -> tuple[dict[str, Any], TPTrace, list]:
    """``(comm_per_step, trace, stages)`` for a pipeline plan: the busiest pp rank's rows
    (the largest wire bytes) under the usual keys, every pp rank's in ``pp_ranks``; the
    busiest rank's TP trace (its stages' collectives of one micro-batch, summed) and its
    :class:`StageComm`\\ s, for the minimum. ``cache``: ``search``'s (:func:`_stages`)."""
    spec, dims = result.plan.spec, result.resolution.dims
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
    positions = reported_ranks(dims.pp)
    ranks, traces = [], []
    for rank in range(dims.pp):
        local = split.of_rank(rank)
        counts: Counter = Counter()
        for s in local:
            counts.update(stages[s.index].trace.counts)
        first = stages[local[0].index].trace
        traces.append(TPTrace(counts, first.depths, first.blocks))
        fsdp = _rank_fsdp(result, order[rank], local, {i: s.units for i, s in stages.items()},
                          param, reduce)
        collectives = rows(traces[-1], fsdp, step, dims) + _p2p_rows(p2p.get(rank))
        ranks.append(dict(pp_rank=rank, position=positions.get(rank),
                          stages=[s.index for s in local], collectives=collectives,
                          wire_bytes=sum(c["wire_bytes"] for c in collectives)))
    busiest = max(ranks, key=lambda r: r["wire_bytes"])
    mine = [stages[i] for i in busiest["stages"]]
    return dict(pp_rank=busiest["pp_rank"], stages=busiest["stages"],
                collectives=busiest["collectives"], pp_ranks=ranks), \
        traces[busiest["pp_rank"]], mine


def _rank_fsdp(result, order: list, local: list, units: dict[int, list],
               param: torch.dtype, reduce: torch.dtype) -> list[dict[str, Any]]:
    """A pp rank's FSDP2 collectives per step: its stages' (``local``) units (``units``, by
    stage index), all-gathered as often as its ``order`` makes FSDP2 gather them."""
    spec, dims, shape = result.plan.spec, result.resolution.dims, result.step
    reshard = bool(spec.fsdp and spec.fsdp.reshard_after_forward)
    fsdp = []
    for s in local:
        memo: dict[bool, int] = {}  # a unit's gathers depend on whether it reshards only

        def gathers(unit: str, index: int = s.index, memo: dict = memo) -> int:
            again = reshard and unit != ROOT
            if again not in memo:
                memo[again] = fsdp_gathers(order, index, again)
            return memo[again]
        fsdp += fsdp_collectives(units[s.index], spec.fsdp, shape, dims, param.itemsize,
                                 reduce.itemsize, gathers)
    return fsdp


def pipeline_fsdp_rows(result, param: torch.dtype, reduce: torch.dtype, step: Accumulation,
                       cache: dict | None = None) -> list[list[dict[str, Any]]]:
    """Each pp rank's FSDP2 rows of ``comm_per_step`` (:func:`pipeline_comm`'s, without its
    TP and p2p rows), from the stages' units alone: no trace runs. ``cache``: as
    :func:`pipeline_comm`'s."""
    spec, dims = result.plan.spec, result.resolution.dims
    pipe = spec.pipeline
    _, split, _, parts = _parts(result, {} if cache is None else cache, units_only=True)
    order = fsdp_order(pipe.schedule, dims.pp, pipe.stages_per_rank, pipe.microbatches)
    units = {i: p[2] for i, p in parts.items()}
    empty = TPTrace(Counter(), [], None)
    return [rows(empty, _rank_fsdp(result, order[rank], split.of_rank(rank), units, param,
                                   reduce), step, dims) for rank in range(dims.pp)]


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
