"""Live memory over a training step, by part: every storage the step allocates, followed.

:class:`MemoryTracker` is a ``TorchDispatchMode`` below DTensor (it sees the local ops, as a
rank does), so it works the same on real tensors and on fake ones. Each storage an op
creates is held by a weak reference: its bytes count from the op that made it until it
is freed (or resized: FSDP2 allocates and frees its unsharded parameters with
``UntypedStorage.resize_``). Each storage belongs to one *part*, decided when it appears:

- what exists before the step is registered by the caller: ``parameters``, ``buffers``,
  ``optimizer`` state, ``gradients``, the inputs;
- FSDP2's unsharded parameters (what ``fsdp.split_with_sizes_copy`` copies the all-gather
  into, or a storage FSDP2 resizes) are ``fsdp_unsharded``, and so is a unit's all-gather
  buffer from the all-gather until it is copied out: a unit FSDP2 prefetches (the next one
  in backward) is held gathered beside the unit computing, and both are its unsharded
  state. Once copied out, the buffer (kept in forward to overlap the next all-gather) and
  the reduce-scatter's buffers are ``transients``; the reduce-scatter's output is
  ``gradients``;
- anything else is the current phase's: ``activations`` in forward, ``transients`` in
  backward (gradients of activations, recomputed blocks, unsharded gradients of the unit
  being reduced) and in the optimizer step.

The caller reclassifies at the end of a backward (:meth:`settle`): each parameter's
gradient becomes ``gradients``, other survivors of backward (FSDP2's unsharded gradients
kept while gradient sync is off) ``accumulated_gradients``. Sizes are the storages' own
bytes (no allocator rounding). Per *moment label* (which module, which pass, which
micro-batch; see :func:`tpplan.analysis.memory.step`) the tracker keeps the largest total
with its split by part, and each part's own largest value. Its subclass
:class:`tpplan.analysis.memory.dp_shards.ScalableTracker` (``search``'s) also tells FSDP2's shards
apart from the rest, so that one trace gives the moments of every other dp_shard.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from typing import Any, Callable, Iterable

import torch
from torch.distributed.tensor import DTensor

from ..._torch.dispatch import Traced, TorchDispatchMode, is_traceable_wrapper_subclass, tree_flatten
from ..._torch.dtensor import sharding_propagation_marked
from ..._torch.ops import RECORD_FUNCTION_MARKS, reduce_scatter_base
from ..._torch.storage import resizes_seen

# Ops that make no tensor: a tensor's device asked (half of a step's dispatches), and
# record_function's marks (FSDP2's hooks name their work for the profiler).
_NOTHING_MADE = {torch.ops.prim.device.default, *RECORD_FUNCTION_MARKS}

__all__ = ["PARTS", "Moment", "MemoryTracker"]

PARTS = ("parameters", "buffers", "optimizer", "gradients", "fsdp_unsharded",
         "accumulated_gradients", "activations", "transients")


class Moment:
    """The largest total seen under one label, its split by part, and each part's maximum."""

    __slots__ = ("total", "parts", "part_max")

    def __init__(self) -> None:
        self.total = -1
        self.parts: dict[str, int] = {}
        self.part_max: dict[str, int] = {}

    def to_json(self) -> dict[str, Any]:
        return {"total": self.total, "parts": dict(self.parts), "part_max": dict(self.part_max)}


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        return [s for a in attrs for s in _storages(getattr(t, a))
                if isinstance(getattr(t, a), torch.Tensor)]
    return [t.untyped_storage()]


def _ops() -> tuple[set, set, Any, Any]:
    """FSDP2's ops, by what they make: (unsharded-parameter copies, collective buffers,
    reduce-scatter, all-gather buffer); looked up lazily, since FSDP2 registers them on
    import."""
    import torch.distributed.fsdp  # noqa: F401  (registers torch.ops.fsdp)

    fsdp = torch.ops.fsdp
    copies = {fsdp.split_with_sizes_copy.default}
    buffers = {fsdp.all_gather_copy_in.default, fsdp.chunk_cat.default}
    return copies, buffers, reduce_scatter_base(), fsdp.all_gather_copy_in.default


class _Propagating:
    """Marks DTensor's sharding propagation, which runs each op once on fake tensors of the
    global shapes to learn the output's: no memory of any rank. PyTorch brackets it with
    :func:`~tpplan._torch.dtensor.sharding_propagation_marked`; ours counts the nesting."""

    def __init__(self, tracker: "MemoryTracker"):
        self.tracker = tracker

    def __enter__(self):
        self.tracker._propagating += 1

    def __exit__(self, *args):
        self.tracker._propagating -= 1


class MemoryTracker(Traced, TorchDispatchMode):
    """Live bytes by part over a step; ``moments[label]`` the largest moment of each label.

    Example::

        >>> tracker = MemoryTracker(where=lambda: "step")
        >>> tracker.register(model.parameters(), "parameters")
        >>> with tracker:
        ...     tracker.phase = "activations"; loss = model(x).sum()
        ...     tracker.phase = "transients"; loss.backward()
        >>> tracker.moments["step"].total            # the step's peak, bytes
    """

    def __init__(self, where: Callable[[], str] = lambda: "") -> None:
        super().__init__()
        self.where = where
        self.phase = "activations"
        self.live: Counter = Counter({p: 0 for p in PARTS})
        self.moments: dict[str, Moment] = {}
        self._info: dict[int, list] = {}  # id(storage) -> [weakref, part, bytes, sharded]
        self.shard: Counter | None = None  # FSDP2's shards' bytes by part (dp_shards' tracker)
        self._copies, self._buffers, self._scatter, self._gather = _ops()
        self._patches: contextlib.ExitStack | None = None
        self._propagating = 0
        self.kernels = None  # a KernelCount (tpplan.analysis.memory.kernels): every op counted

    # storages
    def _entry(self, st: torch.UntypedStorage) -> list | None:
        e = self._info.get(id(st))
        return e if e is not None and e[0]() is st else None

    def _freed(self, key: int, ref: weakref.ref) -> None:
        e = self._info.get(key)
        if e is not None and e[0] is ref:
            self._move(e, None)
            del self._info[key]

    def _move(self, e: list, part: str | None, sharded: bool | None = None) -> None:
        """Move storage entry ``e``'s bytes to ``part`` (None: freed), ``sharded`` or not."""
        self.live[e[1]] -= e[2]
        if e[3]:
            self.shard[e[1]] -= e[2]
        if part is not None:
            e[1] = part
            e[3] = e[3] if sharded is None else sharded
            self.live[part] += e[2]
            if e[3]:
                self.shard[part] += e[2]

    def track(self, t: torch.Tensor, part: str, retag: bool | tuple = False,
              sharded: bool = False) -> None:
        """Count ``t``'s storages under ``part``; ``retag``: move them there if counted
        already (a tuple: only from those parts); ``sharded``: they are FSDP2 shards
        (followed where :attr:`shard` is)."""
        sharded = sharded and self.shard is not None
        for st in _storages(t):
            e = self._entry(st)
            if e is None:
                self._add(st, part, sharded)
            elif retag and (e[1] != part or sharded) and (retag is True or e[1] in retag):
                self._move(e, part, sharded or e[3])

    def register(self, tensors: Iterable[torch.Tensor | None], part: str,
                 sharded: Callable[[torch.Tensor], bool] = lambda t: False) -> None:
        """Count tensors that exist already (parameters, optimizer state, inputs);
        ``sharded(t)``: whether ``t`` is an FSDP2 shard."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self.track(t.to_local() if isinstance(t, DTensor) else t, part, retag=True,
                           sharded=sharded(t))

    def is_sharded(self, t: torch.Tensor) -> bool:
        e = self._entry(t.untyped_storage())
        return e is not None and e[3]

    def settle(self, grads: Iterable[torch.Tensor | None]) -> None:
        """End of a backward: ``grads`` are ``gradients``; other survivors of backward are
        gradients FSDP2 keeps unsharded until sync (``accumulated_gradients``)."""
        self.register(grads, "gradients")
        for e in self._info.values():
            if e[1] == "transients" and e[0]() is not None:
                self._move(e, "accumulated_gradients")
        self.observe()

    def snapshot(self) -> dict[str, int]:
        return {p: int(v) for p, v in self.live.items()}

    # moments
    def observe(self) -> str:
        label = self.where()
        m = self.moments.get(label)
        if m is None:
            m = self.moments[label] = Moment()
        live = self.live
        total = sum(live.values())
        if total > m.total:
            m.total, m.parts = total, self.snapshot()
        pm = m.part_max
        for p, v in live.items():
            if v > pm.get(p, -1):
                pm[p] = int(v)
        return label

    def _shards(self, func, args, kwargs, out) -> Any:
        """The sizes (elements) of ``func``'s new outputs that are FSDP2 shards: none here
        (:class:`tpplan.analysis.memory.dp_shards.ScalableTracker` follows them)."""
        return ()

    def _add(self, st: torch.UntypedStorage, part: str, sharded: bool = False) -> list:
        key = id(st)
        ref = weakref.ref(st, lambda r, key=key: self._freed(key, r))
        e = self._info[key] = [ref, part, 0, sharded]
        self._resize_entry(e, st.nbytes())
        return e

    def _resize_entry(self, e: list, size: int) -> None:
        self.live[e[1]] += size - e[2]
        if e[3]:
            self.shard[e[1]] += size - e[2]
        e[2] = size

    def _resized(self, st: torch.UntypedStorage, size: int) -> None:
        # Only FSDP2 resizes storages here: one it made before we looked is its unsharded data.
        e = self._entry(st) or self._add(st, "fsdp_unsharded")
        self._resize_entry(e, size)
        self.observe()

    def __enter__(self):
        self._patches = contextlib.ExitStack()
        self._patches.enter_context(resizes_seen(self._resized))
        self._patches.enter_context(sharding_propagation_marked(_Propagating(self)))
        return super().__enter__()

    def __exit__(self, *args):
        self._patches.close()
        return super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _NOTHING_MADE:
            return func(*args, **(kwargs or {}))
        if any(t is DTensor or issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor run its local ops, which we see
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._propagating:
            return out  # DTensor's sharding propagation: fake tensors of global shapes, no memory
        if self.kernels is not None:
            self.kernels.add(func, args, kwargs, out, self.where())
        part = self.phase
        if func in self._buffers:  # FSDP2's collective buffers, and the copies made for them
            part = "transients"
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, torch.Tensor):
                    self.track(t, part, retag=("activations",))
            if func is self._gather:  # the unit's parameters, gathered: unsharded state
                part = "fsdp_unsharded"
                self.track(args[1], part, retag=True)  # the all-gather's output buffer
        elif func is self._scatter:  # its output: a sharded gradient
            self.track(args[0], "gradients", retag=True, sharded=True)
        elif func in self._copies:
            self.track(args[0], "transients", retag=("fsdp_unsharded",))  # copied out
            for t in tree_flatten(kwargs.get("out", args[-1]))[0]:
                if isinstance(t, torch.Tensor):
                    self.track(t, "fsdp_unsharded", retag=True)
        shards = self._shards(func, args, kwargs, out)  # outputs of these sizes are shards
        # Most ops return one tensor: tracked without flattening the output.
        for t in (out,) if isinstance(out, torch.Tensor) else tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.track(t, part, sharded=t.numel() in shards)
        self.observe()
        return out
