"""Counting collectives as the plan really issues them: CommDebugMode plus sizes.

:class:`CollectiveRecorder` *is* a ``CommDebugMode`` (its ``get_comm_counts()`` is
PyTorch's own count: every collective goes through CommDebugMode's dispatch, the other ops
skip its table of every operation, which nothing here reads); it also writes down, for
every collective, its kind, the process group it ran on, whether it ran in backward, the
module it ran under, and the bytes of its full buffer — which CommDebugMode does not keep.
Sizes come from the tensors the collective op receives, so they are right on meta tensors
as well as real ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from ..._torch.collectives import resolve_process_group
from ..._torch.comm_mode import ModuleTracker, c10d_collective_ops
from ..._torch.dispatch import HigherOrderOperator, Traced, op_packet
from ...parallel.meta_kernel_cache import META

__all__ = ["Collective", "CollectiveRecorder", "KINDS"]

# op name (in the functional and c10d namespaces) -> the kind we report
KINDS: dict[str, str] = {
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "_allgather_base_": "all_gather", "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "all_to_all_single": "all_to_all", "alltoall_base_": "all_to_all", "alltoall_": "all_to_all",
    "broadcast": "broadcast", "broadcast_": "broadcast",
}
_NAMESPACES = ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "c10d")


@dataclass(frozen=True)
class Collective:
    kind: str  # all_reduce, all_gather, reduce_scatter, all_to_all, broadcast
    group: str  # the process group's name
    group_size: int
    bytes: int  # the full buffer: all-gather's output, reduce-scatter's input
    backward: bool
    module: str  # the innermost module it ran under (CommDebugMode's tracker)


def _nbytes(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


def _buffer_bytes(op: str, kind: str, size: int, args) -> int:
    if op in ("_allgather_base_", "_reduce_scatter_base_"):  # c10d: (output, input, group)
        return _nbytes(args[0] if kind == "all_gather" else args[1])
    data = _nbytes(args[0]) if args else 0
    # A functional all-gather receives this rank's shard; report the gathered output.
    gathers_shard = op in ("all_gather_into_tensor", "all_gather_into_tensor_coalesced")
    return data * size if gathers_shard else data


def _group_name(args, kwargs) -> str:
    if "group_name" in kwargs:
        return str(kwargs["group_name"])
    # Functional collectives take the group name as the last positional argument.
    last = args[-1] if args else None
    if isinstance(last, str):
        return last
    # c10d ops (FSDP2's) take the process group itself, boxed for the dispatcher.
    pg = next((a for a in args if isinstance(a, torch.ScriptObject)), None)
    if pg is None:
        return "?"
    import torch.distributed as dist

    return dist.ProcessGroup.unbox(pg).group_name


def _group_size(name: str, args) -> int:
    import torch.distributed as dist

    try:
        return dist.get_world_size(resolve_process_group(name))
    except (ValueError, RuntimeError, KeyError):  # unknown name: read it from the arguments
        ints = [a for a in args if isinstance(a, int) and not isinstance(a, bool)]
        return ints[0] if ints else 1


class CollectiveRecorder(Traced, CommDebugMode):
    """``CommDebugMode`` that also records each collective's size, group and pass.

    Example::

        >>> with CollectiveRecorder() as rec:
        ...     model(tokens).sum().backward()
        >>> rec.get_comm_counts()          # PyTorch's count, by op
        >>> rec.collectives[0].bytes       # ours: sizes, groups, forward/backward
    """

    def __init__(self) -> None:
        super().__init__()
        self.advanced_module_tracker = ModuleTracker()
        self.collectives: list[Collective] = []
        self._collective_ops: dict = {}  # op -> whether CommDebugMode counts it

    def _counted(self, func) -> bool:
        """Whether CommDebugMode counts ``func`` (its own test, remembered per op)."""
        known = self._collective_ops.get(func)
        if known is None:
            packet = op_packet(func)
            known = self._collective_ops[func] = packet in self.comm_registry or \
                packet in c10d_collective_ops
        return known

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, HigherOrderOperator) or not self._counted(func):
            # Not a collective: CommDebugMode would only add the op to its per-module
            # operations table (input shapes, placements and ``str(device_mesh)`` for every
            # DTensor op, which at 1,024 ranks prints the mesh), which nothing here reads.
            # As it does: DTensor runs first, and its local ops come back here.
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented
            return META(func, args, kwargs or {})  # a meta kernel's output kept
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is NotImplemented:
            return out
        packet = op_packet(func)
        namespace = getattr(func, "namespace", "")
        kind = KINDS.get(packet.__name__)
        if kind is None or namespace not in _NAMESPACES:
            return out
        kwargs = kwargs or {}
        name = _group_name(args, kwargs)
        size = _group_size(name, args)
        data = _buffer_bytes(packet.__name__, kind, size, args)
        tracker = self.advanced_module_tracker
        self.collectives.append(Collective(kind, name, size, data, bool(tracker.is_bw),
                                           tracker.name))
        return out
