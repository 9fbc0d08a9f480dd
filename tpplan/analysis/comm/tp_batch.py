"""A TP trace in the micro-batch: ``tpplan search`` traces three micro-batch sizes of one
key and extrapolates the others, checked (docs/search.md, "The cache").

Only shapes change with the micro-batch: which collectives run, in which modules and pass,
and how many, do not; an activation's collective moves ``a·b`` bytes, a gradient's
reduction after backward or a scalar's a constant. :func:`extrapolated` holds three traces
to that (every collective's bytes on one line through them, what a stage receives and
sends too) or refuses; :func:`traced_in_batch` is the cache that uses it.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

from .tp_trace import TPTrace

__all__ = ["extrapolated", "traced_in_batch"]


def _affine(points: list[tuple[int, int]], b: int) -> int | None:
    """``y(b)`` of the line through ``points`` (three ``(x, y)`` of distinct x), None where
    they are not on one line or ``y(b)`` is not a whole number at least 0."""
    (x1, y1), (x2, y2), (x3, y3) = points
    if (y2 - y1) * (x3 - x2) != (y3 - y2) * (x2 - x1):
        return None
    y, rest = divmod(y1 * (x2 - x1) + (y2 - y1) * (b - x1), x2 - x1)
    return y if not rest and y >= 0 else None


def _by_collective(counts: Counter) -> dict[tuple, list[tuple[int, int]]]:
    """``counts`` as (kind, mesh dimension, backward?, module) -> [(bytes, count), ...] by bytes."""
    out: dict[tuple, list[tuple[int, int]]] = {}
    for (kind, dim, bw, nbytes, module), n in counts.items():
        out.setdefault((kind, dim, bw, module), []).append((nbytes, n))
    return {k: sorted(v) for k, v in out.items()}


def extrapolated(points: list[tuple], micro_batch: int, received: tuple | None
                 ) -> tuple[TPTrace, tuple | None] | None:
    """A stage's trace at ``micro_batch`` from three traced at other micro-batch sizes, or
    None where they do not determine it. ``points``: ``(micro_batch, received, trace,
    sent)`` of three traces (``received``/``sent``: the (shape, dtype) a stage takes and
    sends on, or None).

    Only shapes grow with the micro-batch: an activation's collective moves ``a·b`` bytes, a
    gradient's reduction after backward or a scalar's a constant, a sequence-sharded
    buffer's ``a·b + c`` at most; the program (which collectives, in which modules, how
    many) does not change. Checked, like the depth extrapolation: the three traces have the
    same collectives (kind, mesh dimension, pass, module) with the same counts once sorted
    by bytes, each one's bytes on a line through the three, the shapes received and sent
    too; and ``received`` is that line's. Anything else: None (the caller traces)."""
    xs = [p[0] for p in points[:3]]
    if len(set(xs)) < 3 or micro_batch in xs:
        return None
    traces, sents, receiveds = [p[2] for p in points[:3]], [p[3] for p in points[:3]], \
        [p[1] for p in points[:3]]
    if len({(tuple(t.depths), t.blocks) for t in traces}) != 1:
        return None

    def shape_at(shapes: list, want: tuple | None = None) -> tuple | None | bool:
        """The (shape, dtype) on the line through ``shapes``; False where there is none."""
        if all(s is None for s in shapes):
            return None
        if any(s is None for s in shapes) or len({(len(s[0]), s[1]) for s in shapes}) != 1:
            return False
        dims = [_affine([(x, s[0][i]) for x, s in zip(xs, shapes)], micro_batch)
                for i in range(len(shapes[0][0]))]
        return False if None in dims else (tuple(dims), shapes[0][1])

    if shape_at(receiveds) != received:
        return None
    sent = shape_at(sents)
    groups = [_by_collective(t.counts) for t in traces]
    if sent is False or any(g.keys() != groups[0].keys() for g in groups):
        return None
    counts: Counter = Counter()
    for key, first in groups[0].items():
        rows = [g[key] for g in groups]
        if len({len(r) for r in rows}) != 1 or len({tuple(n for _, n in r) for r in rows}) != 1:
            return None
        for i, (_, n) in enumerate(first):
            nbytes = _affine([(x, r[i][0]) for x, r in zip(xs, rows)], micro_batch)
            if nbytes is None:
                return None
            kind, dim, bw, module = key
            counts[(kind, dim, bw, nbytes, module)] += n
    return TPTrace(counts, list(traces[0].depths), traces[0].blocks), sent


def traced_in_batch(cache: dict, key: tuple, micro_batch: int, received: tuple | None,
                    run: Callable[[int, tuple | None], tuple[TPTrace, tuple | None]],
                    counts: Counter | None = None, name: str = "tp"
                    ) -> tuple[TPTrace, tuple | None]:
    """``run(micro_batch, received)`` (a trace and the (shape, dtype) it sends on, a stage's;
    None for a whole model) cached in ``cache`` under ``key`` (all the trace reads but the
    micro-batch and ``received``), the micro-batch and ``received``. Past the first three
    micro-batch sizes traced under ``key``, a trace is those three :func:`extrapolated`
    where their check holds, else traced. ``counts[name]`` counts the traces run,
    ``_cached`` the answers from the cache, ``_from_batches`` the extrapolated ones."""
    counts = Counter() if counts is None else counts
    exact = ("trace", key, micro_batch, received)
    if exact in cache:
        counts[f"{name}_cached"] += 1
        return cache[exact]
    points = cache.setdefault(("points", key, received and (len(received[0]), received[1])), [])
    got = extrapolated(points, micro_batch, received) if len(points) >= 3 else None
    if got is None:
        got = run(micro_batch, received)
        counts[name] += 1
        if len(points) < 3:
            points.append((micro_batch, received, *got))
    else:
        counts[f"{name}_from_batches"] += 1
    cache[exact] = got
    return got
