"""The dry run's process group: PyTorch's ``fake`` backend (collectives return at once) at
any world size, and what the dry run changes in torch while it is up, each an identity on
what a trace sees that makes it cheaper: FSDP2's chunks made on demand, a mesh pair joined
once, only this rank's process groups made, the garbage collector run less often."""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

__all__ = ["ChunksOnDemand", "fake_process_group", "fewer_collections", "forget_meshes"]


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """A process group of ``world_size`` ranks in which collectives do nothing."""
    if dist.is_initialized():
        raise RuntimeError("a process group is already running; the dry run needs its own")
    dist.init_process_group("fake", rank=rank, world_size=world_size)
    try:
        with _fsdp_init_on_demand(), _own_groups_only(rank), fewer_collections():
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


@contextlib.contextmanager
def _own_groups_only(rank: int) -> Iterator[None]:
    """DeviceMesh's process groups made only where this rank is in them. A mesh makes every
    subgroup of each dimension, as every rank must in a real run (``new_group`` is
    collective), and keeps the one holding this rank; in the fake group only this rank runs,
    so the others (2,047 of 2,048 tp groups at 16,384 ranks) are not made: each would be
    handed back as "not a member" and dropped. At 16,384 ranks this was 12.6 s of 87 of a
    405B search's (docs/benchmarks.md)."""
    from torch.distributed import device_mesh
    from torch.distributed.distributed_c10d import GroupMember

    original = device_mesh.new_group

    def new_group(*args, **kwargs):
        ranks = kwargs.get("ranks", args[0] if args else None)
        if ranks is not None and rank not in ranks:
            return GroupMember.NON_GROUP_MEMBER
        return original(*args, **kwargs)

    device_mesh.new_group = new_group
    try:
        yield
    finally:
        device_mesh.new_group = original


@contextlib.contextmanager
def _fsdp_init_on_demand() -> Iterator[None]:
    """FSDP2's parameter sharding with :class:`ChunksOnDemand`, each mesh pair joined once and
    each data-parallel mesh's shard dimension sliced once: the same tensors and meshes, made
    only as often as they differ; and its parameter groups without profiler marks."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    original_chunks, original_concatenate = _fsdp_param._chunk_with_empty, DeviceMesh._concatenate
    original_shard_mesh = _fsdp_param.FSDPParam._init_shard_mesh
    original_marks = _fsdp_param_group.record_function
    concatenated: dict[tuple[int, ...], tuple[list, DeviceMesh]] = {}
    sliced: dict[int, tuple[DeviceMesh, DeviceMesh]] = {}

    def concatenate(meshes: list) -> DeviceMesh:
        # FSDP2 joins its data-parallel mesh and a parameter's TP mesh once per parameter;
        # the joined mesh depends only on the two meshes, so each pair is joined once.
        key = tuple(map(id, meshes))
        if key not in concatenated:  # the meshes are kept with it, so their ids stay theirs
            concatenated[key] = (list(meshes), original_concatenate(meshes))
        return concatenated[key][1]

    def shard_mesh(param) -> DeviceMesh:  # noqa: ANN001 - an FSDPParam
        # Under HSDP every parameter of a unit slices its 2-D mesh's shard dimension anew
        # (a DeviceMesh each, equal to the others): a third of a first forward's setup (8B).
        mesh = param.mesh_info.mesh
        if id(mesh) not in sliced:  # the mesh is kept with its slice, so its id stays its own
            sliced[id(mesh)] = (mesh, original_shard_mesh(param))
        return sliced[id(mesh)][1]

    _fsdp_param._chunk_with_empty = ChunksOnDemand
    DeviceMesh._concatenate = staticmethod(concatenate)
    _fsdp_param.FSDPParam._init_shard_mesh = shard_mesh
    # A parameter group's profiler marks (eight a unit a micro-batch): ops that make nothing,
    # each a dispatch through every mode up; no dry run has a profiler to read them.
    _fsdp_param_group.record_function = lambda _name: contextlib.nullcontext()
    try:
        yield
    finally:
        _fsdp_param._chunk_with_empty = original_chunks
        DeviceMesh._concatenate = staticmethod(original_concatenate)
        _fsdp_param.FSDPParam._init_shard_mesh = original_shard_mesh
        _fsdp_param_group.record_function = original_marks


def forget_meshes() -> None:
    """Empty DTensor's caches of sharding decisions. They key on meshes, and a mesh compares
    equal to one of the same shape and names from an earlier process group (DeviceMesh's
    ``__eq__`` ignores the groups): a second dry run in the same process (``--device``'s
    checked changes) would otherwise be handed DTensors on the first run's meshes, whose
    process groups are gone (``Could not resolve the process group``)."""
    from torch.distributed.tensor import DTensor, _redistribute

    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ dispatch fast path's
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()


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
