"""DTensor's internals: its sharding caches, its sharding propagation, its shard offsets.

Checked on torch 2.11 through 2.14.1. ``ShardingPropagator._fake_mode_lock`` (the context
DTensor runs its fake sharding propagation in) exists from 2.13; on 2.11
:func:`sharding_propagation_marked` wraps ``_propagate_tensor_meta_non_cached`` instead.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

__all__ = ["clear_sharding_caches", "compute_local_shape_and_global_offset",
           "sharding_propagation_marked"]


def clear_sharding_caches() -> None:
    """Empty DTensor's caches of sharding decisions: the C++ fast path's
    (``torch._C._clear_DTensor_sharding_propagator_cache``), the Python propagator's
    (``DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding``, an lru cache) and
    redistribution's (``_redistribute._gen_transform_infos``), all 2.11-2.14.1."""
    from torch.distributed.tensor import DTensor, _redistribute

    torch._C._clear_DTensor_sharding_propagator_cache()
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()


@contextlib.contextmanager
def sharding_propagation_marked(marker: contextlib.AbstractContextManager) -> Iterator[None]:
    """Within the block, every run of DTensor's fake sharding propagation (each op run once
    on fake tensors of the global shapes to learn the output's) is bracketed by ``marker``.

    torch 2.13-2.14.1 bracket it with the class attribute
    ``ShardingPropagator._fake_mode_lock`` (a ``nullcontext`` by default), replaced here; torch
    2.11 has no such attribute, and its ``_propagate_tensor_meta_non_cached`` (the one method
    that runs the ops) is wrapped instead. Restored on exit."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    if hasattr(ShardingPropagator, "_fake_mode_lock"):
        lock = ShardingPropagator._fake_mode_lock
        ShardingPropagator._fake_mode_lock = marker
        try:
            yield
        finally:
            ShardingPropagator._fake_mode_lock = lock
        return
    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate(self, op_schema):  # noqa: ANN001, ANN202 - ShardingPropagator's
        with marker:
            return original(self, op_schema)

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original
