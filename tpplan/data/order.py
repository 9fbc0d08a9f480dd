"""Which window each sample of a run reads: a pure function of (seed, sample index).

Two pieces, both closed forms, so nothing grows with the corpus or the step:

- :func:`route`: sample ``k`` of the run goes to one source of a mixture, with its ordinal
  there (how many samples that source served before it). A binary tree over the sources
  splits the samples reaching each node by the weights below it with a Bresenham rule
  (``floor(m·p + ½)``): after any ``K`` samples every source has served its share within one
  sample per tree level -- exact shares, no randomness to drift, as Megatron's
  ``BlendedDataset`` promises, but without its per-sample index.
- :func:`permute`: a source's ``n`` windows in a different order each epoch, as a keyed
  bijection of ``[0, n)`` (a Feistel network, walked until it lands inside ``n``). A
  ``randperm(n)`` would hold 8 bytes a window: 128 MB for 16M windows, on every rank.

The global batch of step ``s`` is samples ``(s - 1)·B … s·B - 1``: it does not depend on
the number of data-parallel ranks, so a run resumed on another mesh reads the same data.
"""

from __future__ import annotations

import hashlib

import numpy as np

__all__ = ["consumed", "key_of", "permute", "route"]

ROUNDS = 4
_M1 = np.uint64(0x9E3779B97F4A7C15)
_M2 = np.uint64(0xBF58476D1CE4E5B9)


def key_of(*parts: object) -> int:
    """A 64-bit key from ``parts`` (seed, source, epoch): the same on every rank and run."""
    digest = hashlib.sha256(":".join(map(str, ("order", *parts))).encode()).digest()
    return int.from_bytes(digest[:8], "little")


def _round(r: np.ndarray, key: int, half: int) -> np.ndarray:
    x = (r + np.uint64(key)) * _M1
    x ^= x >> np.uint64(31)
    x *= _M2
    x ^= x >> np.uint64(29)
    return x & np.uint64((1 << half) - 1)


def _feistel(x: np.ndarray, keys: list[int], half: int) -> np.ndarray:
    mask = np.uint64((1 << half) - 1)
    left, right = x >> np.uint64(half), x & mask
    for k in keys:
        left, right = right, left ^ _round(right, k, half)
    return (left << np.uint64(half)) | right


def permute(index: np.ndarray, n: int, key: int) -> np.ndarray:
    """``index`` (values in ``[0, n)``) through a bijection of ``[0, n)`` chosen by ``key``."""
    if n <= 1:
        return np.zeros_like(np.asarray(index, dtype=np.int64))
    half = max(1, ((n - 1).bit_length() + 1) // 2)  # a domain of 4^half >= n, < 4n
    keys = [key_of(key, r) for r in range(ROUNDS)]
    with np.errstate(over="ignore"):
        x = _feistel(np.asarray(index, dtype=np.uint64), keys, half)
        out = x >= n
        while out.any():  # cycle-walk: < 4 rounds on average, the result stays a bijection
            x[out] = _feistel(x[out], keys, half)
            out = x >= n
    return x.astype(np.int64)


def _tree(weights: list[float]) -> list[tuple[int, int, int]]:
    """Nodes (lo, mid, hi) of a balanced binary tree over sources ``[0, len)``."""
    nodes, todo = [], [(0, len(weights))]
    while todo:
        lo, hi = todo.pop()
        if hi - lo > 1:
            mid = (lo + hi) // 2
            nodes.append((lo, mid, hi))
            todo += [(lo, mid), (mid, hi)]
    return nodes


def _left_share(weights: np.ndarray, lo: int, mid: int, hi: int) -> float:
    total = weights[lo:hi].sum()
    return float(weights[lo:mid].sum() / total) if total > 0 else 0.0


def route(k: np.ndarray, weights: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """(source, ordinal within the source) of each global sample index in ``k``."""
    w = np.asarray(weights, dtype=np.float64)
    m = np.asarray(k, dtype=np.int64).copy()
    lo = np.zeros(len(m), dtype=np.int64)
    hi = np.full(len(m), len(w), dtype=np.int64)
    shares = {(a, c): _left_share(w, a, b, c) for a, b, c in _tree(weights)}
    while True:
        active = hi - lo > 1
        if not active.any():
            return lo, m
        for (a, c), p in shares.items():
            at = active & (lo == a) & (hi == c)
            if not at.any():
                continue
            mm = m[at].astype(np.float64)
            before = np.floor(mm * p + 0.5).astype(np.int64)
            left = np.floor((mm + 1) * p + 0.5).astype(np.int64) > before
            mid = (a + c) // 2
            m[at] = np.where(left, before, m[at] - before)
            lo[at] = np.where(left, a, mid)
            hi[at] = np.where(left, mid, c)


def consumed(samples: int, weights: list[float]) -> list[int]:
    """How many of the run's first ``samples`` samples each source served (closed form)."""
    out = [0] * len(weights)
    w = np.asarray(weights, dtype=np.float64)

    def down(lo: int, hi: int, count: int) -> None:
        if hi - lo == 1:
            out[lo] = count
            return
        mid = (lo + hi) // 2
        left = int(np.floor(count * _left_share(w, lo, mid, hi) + 0.5))
        down(lo, mid, left)
        down(mid, hi, count - left)

    down(0, len(weights), samples)
    return out
