"""Lower bounds of a candidate's peak memory that drop it before its own step is traced.

``sharded_state`` from arithmetic alone (its parameter shards and AdamW's moments), and
``split_free`` from the trace of another data-parallel split of the same layout: the search
(:mod:`tpplan.analysis.search.ranking`) drops a layout whose bounds already exceed the device.
"""

from __future__ import annotations

from typing import Any

from ..dryrun import DryRun
from ..memory.floor import smallest_element

__all__ = ["SPLIT_FREE", "sharded_state", "split_free"]

SPLIT_FREE = ("activations", "accumulated_gradients", "transients")


def split_free(memory: dict[str, Any]) -> int:
    """The bytes at the peak of ``memory`` (``memory_per_rank``) that the data-parallel split
    (dp_replicate × dp_shard at a fixed product) does not change: activations, temporaries
    and the unsharded gradients kept between micro-batches. Another split of the same layout
    runs the same operations on the same activations, so at that moment it holds these bytes
    and its own parameter shards and optimizer state: its peak is at least this."""
    return sum(memory["at_peak"][p] for p in SPLIT_FREE)


def sharded_state(result: DryRun, units: list | None, size: int | None = None) -> int:
    """A lower bound, from arithmetic alone, of the bytes every moment of ``result``'s step
    holds on its busiest rank: rank 0's padded FSDP2 shard of every unit (``units``, from
    shapes: :func:`tpplan.parallel.fsdp_units.unit_sizes`), in the smallest parameter dtype,
    and AdamW's two moments of each where every parameter is trained. 0 under a pipeline
    (``units`` None: a stage's units are its own). ``size``: that dtype's bytes, where the
    caller has them (:func:`tpplan.analysis.memory.floor.smallest_element`)."""
    if not units:
        return 0
    dims = result.resolution.dims
    shards = {"dp_shard": dims.dp_shard * dims.cp, "efsdp": dims.efsdp}
    elements = sum(u.elements // shards.get(u.mesh_dim, 1) for u in units)
    size = smallest_element(result.model) if size is None else size
    spec = result.plan.spec
    trained = spec.lora is None and not spec.freeze  # else AdamW holds only what is trained
    return elements * size * (3 if trained else 1)
