"""A lower bound of each pp rank's TP collectives, from the whole model's trace: no stage traced.

In a model of identical blocks, a period of blocks (k of them: 1, or the period of selective
checkpointing) with a period on each side receives its input in the layout the one before
produced and its input's gradient in the one after sends back, so it issues what any other
such period issues: the one-run TP trace holds its second and third periods equal and keeps
one (:attr:`tpplan.analysis.comm.tp_trace.TPTrace.period`). A pipeline stage of n of those blocks
has ``n // k - 2`` periods with a whole period on each side, whichever stage it is and
whatever its ends; the stage's own trace issues at least their collectives. So each pp rank
issues, per key, at least its stages' interior periods times the whole model's period
traced at the same micro-batch (and everything else the trace reads): ``search`` adds these
rows to a pipeline layout's bound before its stages are traced (docs/search.md). Under
checkpointing, also from the period traced without it (``plain``): recomputation re-issues
a block's forward collectives and leaves the rest as they are (the same argument as
:func:`tpplan.analysis.traced_rows`), so a stage issues at least what it would without.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from .step import rows
from ..memory.stages import kept_split
from .tp_trace import TPTrace

__all__ = ["tp_key", "interior_rows"]


def tp_key(plan, dims, seq_len: int, dtype, plain: bool = False) -> tuple:
    """What a whole model's TP trace reads that differs between one plan's candidates, but
    the micro-batch (``search``'s cache key, :class:`tpplan.analysis.search.trace_cache.Evaluator`);
    ``plain``: the key of the same trace without checkpointing."""
    ac, cp = plan.activation_checkpointing, plan.context_parallel
    return (dims.tp, dims.ep, dims.cp, cp.method, cp.load_balance, seq_len, dtype,
            *(("none", 1) if plain else (ac.mode, ac.every)))


def interior_rows(result, traces: dict, stage_cache: dict, plain: bool = False
                  ) -> list[list[dict[str, Any]]] | None:
    """Each pp rank's TP rows (:func:`tpplan.analysis.comm.step.rows`) of its stages' interior
    periods, from the period of the whole model's trace kept in ``traces`` under
    ``("period", tp_key, micro_batch)`` (``plain``: the one traced without checkpointing,
    periods of one block); None without a pipeline, without that trace, or where
    checkpointing does not take every block and not ``plain`` (a period's recomputation
    would not be every stage's). ``stage_cache``: the stages' cache (the split, kept)."""
    from ..analyses import accumulation, compute_dtypes

    spec, res, shape = result.plan.spec, result.resolution, result.step
    dims = res.dims
    if spec.pipeline is None:
        return None
    param, reduce = compute_dtypes(result)
    key = tp_key(spec, dims, shape.seq_len, param, plain)
    period = traces.get(("period", key, shape.micro_batch))
    if period is None:
        return None
    split = kept_split(stage_cache, result.model, spec, dims.pp)
    blocks = [b for s in split.stages for b in s.blocks]
    ac = spec.activation_checkpointing
    if ac.enabled and not plain and set(res.ac_blocks) != set(blocks):
        return None
    every = 1 if plain else ac.every
    step = accumulation(result, param, reduce)
    out = []
    for rank in range(dims.pp):
        inner = sum(max(len(s.blocks) // every - 2, 0) for s in split.of_rank(rank))
        counts = Counter({k: n * inner for k, n in period.items()})
        out.append(rows(TPTrace(+counts, [], None), [], step, dims))
    return out
