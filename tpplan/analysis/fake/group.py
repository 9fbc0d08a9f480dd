"""The dry run's process group: PyTorch's ``fake`` backend (collectives return at once) at
any world size, and what the dry run changes in torch while it is up, each an identity on
what a trace sees that makes it cheaper: FSDP2's chunks made on demand, a mesh pair joined
once, only this rank's process groups made, the garbage collector run less often -- and
expert-parallel routing balanced, there being no expert ids on fake tensors to count."""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from ..._torch.dtensor import clear_sharding_caches
from ..._torch.fsdp import fsdp_init_on_demand
from ..._torch.mesh import own_groups_only
from ...parallel.experts.style import balanced_routing
from .experts import balanced_experts

__all__ = ["ChunksOnDemand", "fake_process_group", "fewer_collections", "forget_meshes"]


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """A process group of ``world_size`` ranks in which collectives do nothing; inside it
    ``expert_parallel`` routes evenly (:func:`~tpplan.parallel.experts.style.balanced_routing`)
    and an experts module's own data-dependent operators get balanced sizes
    (:func:`~tpplan.analysis.fake.experts.balanced_experts`)."""
    if dist.is_initialized():
        raise RuntimeError("a process group is already running; the dry run needs its own")
    dist.init_process_group("fake", rank=rank, world_size=world_size)
    try:
        # FSDP2's chunks made on demand, a mesh pair joined once, a shard mesh sliced once.
        # Only this rank's groups made: a mesh makes every subgroup of each dimension, as
        # every rank must in a real run (new_group is collective); in the fake group only
        # this rank runs, so the others (2,047 of 2,048 tp groups at 16,384 ranks) would be
        # handed back as "not a member" and dropped: 12.6 s of 87 of a 405B search's
        # (docs/benchmarks.md).
        with fsdp_init_on_demand(ChunksOnDemand), own_groups_only(rank), fewer_collections(), \
                balanced_routing(), balanced_experts():
            yield
    finally:
        dist.destroy_process_group()
        forget_meshes()


class ChunksOnDemand(Sequence):
    """``torch.chunk(tensor, n, dim)`` padded with empty tensors to ``n`` entries, as FSDP2's
    ``_chunk_with_empty`` returns it, but each chunk made only when it is read. FSDP2 reads
    two of them (this rank's and the first) and builds all ``n``: at 2,048 data-parallel
    ranks that is most of a 405B dry run's time."""

    def __init__(self, tensor: torch.Tensor, num_chunks: int, dim: int) -> None:
        self.tensor, self.num_chunks, self.dim = tensor, num_chunks, dim
        self.size = tensor.size(dim)
        self.chunk = -(-self.size // num_chunks)  # torch.chunk's chunk length

    def __len__(self) -> int:
        return self.num_chunks

    def __getitem__(self, i):  # noqa: ANN001 - an index, as a list takes
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.num_chunks))]
        if i < 0:
            i += self.num_chunks
        if not 0 <= i < self.num_chunks:
            raise IndexError(i)
        if self.size == 0:  # torch.chunk splits an empty dimension into empty chunks, n of them
            return self.tensor.narrow(self.dim, 0, 0)
        start = i * self.chunk
        if start >= self.size:
            return self.tensor.new_empty(0)
        return self.tensor.narrow(self.dim, start, min(self.chunk, self.size - start))


def forget_meshes() -> None:
    """Empty DTensor's caches of sharding decisions. They key on meshes, and a mesh compares
    equal to one of the same shape and names from an earlier process group (DeviceMesh's
    ``__eq__`` ignores the groups): a second dry run in the same process (``--device``'s
    checked changes) would otherwise be handed DTensors on the first run's meshes, whose
    process groups are gone (``Could not resolve the process group``)."""
    clear_sharding_caches()


@contextlib.contextmanager
def fewer_collections(young: int = 50_000):
    """Python's cyclic garbage collector run after every ``young`` new objects, not 700: a
    dry run or a search makes millions of short-lived ones (fake tensors, pytree nodes,
    autograd records), few in cycles, and the default collected the young ones so often
    that it cost 9% of the 8B search (docs/benchmarks.md); memory stays the same. The
    thresholds are put back after."""
    before = gc.get_threshold()
    gc.set_threshold(young, 10, 10)
    try:
        yield
    finally:
        gc.set_threshold(*before)
