"""One memory trace for every ``dp_shard`` of a layout: FSDP2's shards followed apart.

Two layouts that differ only in how the data-parallel ranks split into ``dp_replicate ×
dp_shard`` run the same step: the same operations in the same order on the same
activations. What differs is FSDP2's shard degree (``dp_shard × cp``; an experts module's
``efsdp``, in proportion): every parameter's shard holds ``1/degree`` of its elements, and
so does everything made element by element from shards (AdamW's moments and the
temporaries of its step, a shard cast for a mixed-precision all-gather, the sharded
gradient a reduce-scatter returns and what is made of it). Everything else (activations,
the gathered parameters, the unsharded gradients) has the size of the whole tensor.

So every moment of the step holds ``u + s`` bytes, ``s`` of them in shards, and at another
degree it holds ``u + s × degree / other``, exactly, where no parameter pads its shard at
either degree (dimension 0 a multiple of both: FSDP2 pads a shard up to the largest chunk,
and the gathered tensor with it). :class:`ScalableTracker` marks each storage that is a
shard (FSDP2's sharded parameters and AdamW's state of them when the step starts, a
reduce-scatter's output, a buffer shards are copied into whole, and an op's output with the
elements of one of its shard inputs, unless the op is FSDP2's all-gather or its copy-out)
and keeps, per moment label, every ``(u, s)`` no other moment of that label beats at every
degree (:class:`Points`).
:meth:`ScaledTrace.at` then gives the moments of any other degree, as a trace there would
record them (the first largest moment of each label; each part's own largest), or None
where that is not exact: a parameter would pad, a degree would be 1 (FSDP2 over one rank
gathers nothing), a figure would not be whole bytes.
"""

from __future__ import annotations

from collections import Counter
from fractions import Fraction
from typing import Any, Iterable

import torch
import torch.nn as nn

from ..._torch.fsdp import sharded_params
from ..._torch.ops import FOREACH_COPY
from .tracker import PARTS, MemoryTracker, Moment

__all__ = ["Points", "ScaledTrace", "ScalableTracker", "fsdp_shards"]

_COPIES = (FOREACH_COPY, torch.ops.aten.copy_.default)


def _beaten(points: list, u: int, s: int) -> bool:
    for point in points:
        if point[0] >= u and point[1] >= s:
            return True
    return False


class Points:
    """One label's moments that can be its largest at some degree: ``(u, s)`` pairs (bytes
    not in shards, bytes in shards) none of which another beats in both, in the order
    seen, the first with each part's own split; and each part's own such pairs."""

    __slots__ = ("total", "parts")

    def __init__(self) -> None:
        self.total: list[tuple] = []  # (u, s, parts outside shards, parts in shards)
        self.parts: dict[str, list[tuple[int, int]]] = {p: [] for p in PARTS}

    def add(self, live: dict[str, int], shard: dict[str, int]) -> None:
        s = sum(shard.values())
        u = sum(live.values()) - s
        total = self.total
        if not _beaten(total, u, s):
            total[:] = [x for x in total if not (x[0] <= u and x[1] <= s)]
            total.append((u, s, {p: int(live[p] - shard[p]) for p in PARTS},
                          {p: int(shard[p]) for p in PARTS}))
        for p, points in self.parts.items():
            sp = shard[p]
            up = live[p] - sp
            if points:
                last = points[-1]  # most often the same shards and no more bytes
                if last[0] >= up and last[1] >= sp or _beaten(points, up, sp):
                    continue
            points[:] = [x for x in points if not (x[0] <= up and x[1] <= sp)]
            points.append((int(up), int(sp)))

    def moment(self, f: Fraction) -> Moment | None:
        """This label's moment with every shard ``f`` times its traced size (None: not
        whole bytes)."""
        best = None
        for u, s, up, sp in self.total:  # the first largest, as the tracker keeps it
            v = u + s * f
            if best is None or v > best[0]:
                best = (v, up, sp)
        m = Moment()
        m.total = best[0]
        m.parts = {p: best[1][p] + best[2][p] * f for p in PARTS}
        m.part_max = {p: max(u + s * f for u, s in points)
                      for p, points in self.parts.items() if points}
        values = [m.total, *m.parts.values(), *m.part_max.values()]
        if any(Fraction(v).denominator != 1 for v in values):
            return None
        m.total = int(m.total)
        m.parts = {p: int(v) for p, v in m.parts.items()}
        m.part_max = {p: int(v) for p, v in m.part_max.items()}
        return m


class ScalableTracker(MemoryTracker):
    """A :class:`MemoryTracker` that follows FSDP2's shards apart (:attr:`shard`, by part)
    and keeps each label's :class:`Points`. The caller marks the shards the step starts
    with (``register(..., sharded=...)``); this tracker marks those the step makes."""

    def __init__(self, where) -> None:
        super().__init__(where)
        self.shard = Counter({p: 0 for p in PARTS})
        self.points: dict[str, Points] = {}
        self._scatter_out: int | None = None  # the reduce-scatter output's elements, expected

    def observe(self) -> str:
        label = super().observe()
        points = self.points.get(label)
        if points is None:
            points = self.points[label] = Points()
        points.add(self.live, self.shard)
        return label

    def _shards(self, func, args, kwargs, out) -> Any:
        if func is self._scatter:
            self._scatter_out = None  # reduced into: marked with the gradients
        if func in self._buffers:
            if func is not self._gather:  # the reduce-scatter's copy-in (chunk_cat, over
                # num_chunks = the shard degree): the output FSDP2 allocates next is a shard
                chunks = (*args, None, None)[2] or kwargs["num_chunks"]
                self._scatter_out = kwargs.get("out", args[-1]).numel() // chunks
            return ()
        if func in self._copies:
            return ()  # the all-gather's copy-out: whole tensors
        if func in _COPIES:
            self._copied_into(*((args[0], args[1]) if func is _COPIES[0] else
                                ([args[0]], [args[1]])))
        shards = set()
        for a in args:  # tensors, or lists of them (foreach)
            for t in a if isinstance(a, (list, tuple)) else (a,):
                if isinstance(t, torch.Tensor) and self.is_sharded(t):
                    shards.add(t.numel())
        if self._scatter_out is not None and not shards and isinstance(out, torch.Tensor) \
                and out.numel() == self._scatter_out and self._entry(out.untyped_storage()) is None:
            self._scatter_out, shards = None, {out.numel()}  # allocated, not yet reduced into
        return shards

    def _copied_into(self, dsts, srcs) -> None:
        """A storage that shards are copied into, whole (FSDP2's mixed-precision all-gather
        inputs: one buffer, split), is a shard too: at another degree it takes their size."""
        filled: dict[int, list] = {}
        for d, src in zip(dsts, srcs):
            if self.is_sharded(src):
                st = d.untyped_storage()
                filled.setdefault(id(st), [st, d, 0])[2] += d.numel() * d.element_size()
        for st, d, nbytes in filled.values():
            if nbytes == st.nbytes():
                e = self._entry(st)
                self.track(d, e[1] if e else self.phase, retag=True, sharded=True)


class ScaledTrace:
    """A step traced with its shards followed apart: ``moments`` as traced, and
    :meth:`at` any other ``dp_shard``. ``groups``: each FSDP2 parameter's (shard degree,
    dimension-0 length of what it shards); ``sent``: a pipeline stage's activation sent
    on (:class:`~tpplan.analysis.memory.step.StageIO`)."""

    def __init__(self, moments: dict[str, Moment], points: dict[str, Points], dp_shard: int,
                 groups: Iterable[tuple[int, int]], sent: tuple | None = None):
        self.moments, self.points, self.dp_shard = moments, points, dp_shard
        self.groups, self.sent = sorted(set(groups)), sent

    def at(self, dp_shard: int) -> dict[str, Moment] | None:
        """The moments the same step holds at ``dp_shard`` (every other degree as traced),
        or None where scaling is not exact (module docstring)."""
        if dp_shard == self.dp_shard:
            return self.moments
        if not self.groups:
            return None  # no FSDP2: nothing is sharded over dp_shard, nothing to scale
        for degree, length in self.groups:
            other = Fraction(degree * dp_shard, self.dp_shard)
            if degree == 1 or other.denominator != 1 or other == 1 or \
                    length % degree or length % other:
                return None
        f = Fraction(self.dp_shard, dp_shard)
        out = {}
        for label, points in self.points.items():
            m = points.moment(f)
            if m is None:
                return None
            out[label] = m
        return out


def fsdp_shards(model: nn.Module) -> tuple[set[int], list[tuple[int, int]]]:
    """FSDP2's sharded parameters: the ids of their storages, and each one's (shard degree,
    length of the dimension it shards)."""
    storages, groups = set(), []
    for m in model.modules():
        for storage, degree, length in sharded_params(m):
            storages.add(id(storage))
            groups.append((degree, length))
    return storages, groups
