"""DCP planners that write and read packed parameters in the model's own order.

tpplan holds a packed parameter (``packed_colwise``, ``experts_colwise_rowwise``) as a
DTensor over its tp-interleaved tensor (:mod:`tpplan.plan.packing`): each rank's shard is
one block of that tensor, but in the model's order it is one slice of every part. DCP's
default planners would write the block where the interleaved tensor has it, which is a
different place at every tp. These planners split each rank's block into the runs that are
contiguous in the model's order and write (or read) each run where the model's tensor has
it: checkpoints are keyed and shaped by the full model and load on any mesh, HF
safetensors (whose tensors are in the model's order) load slice by slice, and no rank
gathers anything. Other tensors go through DCP's default code unchanged.

A state-dict entry is packed when one of the segments of its flattened key path is a
packed parameter's name (``model.<fqn>``, ``optim.state.<fqn>.exp_avg``, an HF name).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata, MetadataIndex, TensorProperties,
)
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor

from .._torch.dtensor import compute_local_shape_and_global_offset
from ..plan.packing import Packing, packed_params, runs

__all__ = ["PackedLoadPlanner", "PackedSavePlanner", "packed_of"]

Chunk = tuple[ChunkStorageMetadata, int, int]  # (model-order chunk, local start, length)


def local_chunks(t: DTensor, packing: Packing) -> list[Chunk]:
    """This rank's block of ``t`` as chunks of the model-order tensor."""
    sizes, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    d = packing.dim
    order = packing.order()[offsets[d]:offsets[d] + sizes[d]]
    out = []
    for pos, first, n in runs(order):
        chunk = ChunkStorageMetadata(
            offsets=torch.Size([first if i == d else o for i, o in enumerate(offsets)]),
            sizes=torch.Size([n if i == d else s for i, s in enumerate(sizes)]))
        out.append((chunk, pos, n))
    return out


def _packing_of(path, packed: dict[str, Packing]) -> Packing | None:
    """The packing of the parameter an object path names: ``(model, fqn)``, a nested
    ``(optim, state, fqn, exp_avg)`` or a flattened optimizer's ``(optim, state.fqn.exp_avg)``."""
    for p in path:
        if not isinstance(p, str):
            continue
        if p in packed:
            return packed[p]
        if p.startswith("state.") and p[6:].rpartition(".")[0] in packed:
            return packed[p[6:].rpartition(".")[0]]
    return None


class PackedSavePlanner(DefaultSavePlanner):
    """:class:`DefaultSavePlanner` that writes ``packed`` parameters in the model's order.

    Example::

        >>> dcp.save(state, checkpoint_id=path, planner=PackedSavePlanner(packed_params(model)))
    """

    def __init__(self, packed: dict[str, Packing], **kwargs) -> None:
        super().__init__(**kwargs)
        self.packed = packed
        self._views: dict[tuple, tuple[str, int, int, int]] = {}

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = []
        for item in plan.items:
            t = self.state_dict.get(item.index.fqn)
            packing = _packing_of(self.mappings.get(item.index.fqn, (item.index.fqn,)),
                                  self.packed) if isinstance(t, DTensor) else None
            if packing is None:
                items.append(item)
                continue
            for chunk, pos, n in local_chunks(t, packing):
                index = MetadataIndex(item.index.fqn, chunk.offsets)
                self._views[(index.fqn, tuple(chunk.offsets))] = (index.fqn, packing.dim, pos, n)
                items.append(WriteItem(index=index, type=WriteItemType.SHARD,
                                       tensor_data=dataclasses.replace(
                                           item.tensor_data, chunk=chunk,
                                           properties=TensorProperties.create_from_tensor(
                                               t.to_local()))))
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        view = self._views.get((index.fqn, tuple(index.offset or ())))
        if view is None:
            return super().lookup_object(index)
        fqn, dim, pos, n = view
        return self.state_dict[fqn].to_local().narrow(dim, pos, n).contiguous()


class PackedLoadPlanner(DefaultLoadPlanner):
    """:class:`DefaultLoadPlanner` that reads ``packed`` parameters from the model's order
    (a tpplan checkpoint saved at any tp, or HF safetensors) into this rank's block."""

    def __init__(self, packed: dict[str, Packing], **kwargs) -> None:
        super().__init__(**kwargs)
        self.packed = packed
        self._views: dict[tuple, tuple[int, int, int]] = {}

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = []
        for item in plan.items:
            fqn = item.dest_index.fqn
            t = self.state_dict.get(fqn)
            packing = _packing_of(self.mappings.get(fqn, (fqn,)), self.packed) \
                if isinstance(t, DTensor) else None
            if packing is None:
                items.append(item)
            elif not any(i.dest_index.fqn == fqn for i in items):  # once per tensor
                chunks = local_chunks(t, packing)
                for chunk, pos, n in chunks:
                    self._views[(fqn, tuple(chunk.offsets))] = (packing.dim, pos, n)
                items += create_read_items_for_chunk_list(
                    fqn, self.metadata.state_dict_metadata[fqn], [c for c, _, _ in chunks])
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        view = self._views.get((index.fqn, tuple(index.offset or ())))
        if view is None:
            return super().lookup_tensor(index)
        dim, pos, n = view
        return self.state_dict[index.fqn].to_local().narrow(dim, pos, n)


def packed_of(model: nn.Module | list[nn.Module]) -> dict[str, Packing]:
    """Every packed parameter of ``model``, or of a list of its pipeline stages, by name."""
    return {k: v for m in (model if isinstance(model, list) else [model])
            for k, v in packed_params(m).items()}
