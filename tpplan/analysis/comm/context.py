"""Context parallelism's own traffic per optimizer step against its minimum.

Per attention layer and micro-batch, per rank (docs/long-context.md derives it, with
sources): ``ring`` all-gathers K and V over cp in forward (each rank receives the other
ranks' K and V once) and reduce-scatters their gradients in backward (each rank returns
the others' once); ``ulysses`` runs four all-to-alls each way (q, k, v to head shards and
the output back; in backward their gradients the other way). A block recomputed under
activation checkpointing runs its forward collectives again in backward. Bytes are the
buffer per rank, as the dry run reports every collective: ``b·S·kv·d·e`` for a gathered K
or V, the rank's own ``b·(S/cp)·heads·d·e`` for an all-to-all.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import torch.nn as nn

from ...parallel.context.sequence import attention_shape
from ...parallel.mesh import ParallelDims
from ...plan.specs import PlanSpec
from ...plan.step import StepShape

__all__ = ["cp_minimum", "cp_verdict"]


def cp_minimum(model: nn.Module, spec: PlanSpec, shape: StepShape, dims: ParallelDims,
               e: int) -> tuple[Counter, Counter]:
    """The method's collectives per step as Counter[(kind, backward)] of counts and one of
    bytes; ``e`` bytes per element of the compute dtype."""
    layers, h, kv, d = attention_shape(model)
    h, kv = (n // dims.tp if n >= dims.tp else 1 for n in (h, kv))  # kv replicated below tp
    ac = spec.activation_checkpointing
    recomputed = math.ceil(layers / ac.every) if ac.enabled else 0
    k, b, S, cp = shape.grad_accum, shape.micro_batch, shape.seq_len, dims.cp
    counts: Counter = Counter()
    nbytes: Counter = Counter()

    def add(kind: str, bw: bool, n: int, size: int) -> None:
        counts[(kind, bw)] += k * n
        nbytes[(kind, bw)] += k * n * size

    if spec.context_parallel.method == "ring":
        kv_bytes = b * S * kv * d * e  # one gathered K (or V): the whole sequence's
        add("all_gather", False, 2 * layers, kv_bytes)
        add("all_gather", True, 2 * recomputed, kv_bytes)
        add("reduce_scatter", True, 2 * layers, kv_bytes)
    else:
        local = b * (S // cp) * d * e
        for heads in (h, kv, kv, h):  # q, k, v there; the output back
            add("all_to_all", False, layers, local * heads)
            add("all_to_all", True, layers + recomputed, local * heads)
    return counts, nbytes


def cp_verdict(model: nn.Module, spec: PlanSpec, shape: StepShape, dims: ParallelDims,
               traced: Counter, traced_bytes: Counter, e: int) -> dict[str, Any]:
    """The traced cp collectives (Counter[(kind, backward)]) beside the minimum, kind by kind."""
    counts, nbytes = cp_minimum(model, spec, shape, dims, e)
    rows, extra = [], []
    for kind, bw in sorted(set(counts) | set(traced)):
        p = "backward" if bw else "forward"
        rows.append({"kind": kind, "pass": p, "count": counts[(kind, bw)],
                     "bytes": nbytes[(kind, bw)]})
        dn, db = traced[(kind, bw)] - counts[(kind, bw)], traced_bytes[(kind, bw)] - nbytes[(kind, bw)]
        if dn or db:
            extra.append({"kind": kind, "pass": p, "count": dn, "bytes": db})
    return dict(mesh_dim="cp", method=spec.context_parallel.method, collectives=rows,
                at_minimum=not extra, extra=extra)
