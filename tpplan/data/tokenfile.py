"""A corpus of token ids on disk, memory-mapped and read a window at a time.

:class:`TokenFile` is what every format opens to (:mod:`.formats`): one or more
memory-mapped arrays of ids read as one stream (:class:`Pieces`), optionally the
documents' first tokens (for positions that restart per document, ``data.document_mask``)
and a loss mask (chats: only the assistant's tokens count). Nothing is copied: a window
costs the pages it touches, so a rank's resident memory does not grow with the corpus.

Windows are packed: window ``w`` covers tokens ``w·L … w·L + L`` (``L`` inputs and one more
target, shared with the next window), so every token is a target exactly once an epoch.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["Pieces", "Starts", "TokenFile", "map_file", "unmap"]

AROUND = 1 << 16  # Linux's fault-around block (fault_around_bytes), a multiple of the page


def map_file(path: Path, dtype: str, offset: int = 0, count: int = -1) -> np.ndarray:
    """``path`` (from byte ``offset``) as a read-only memory-mapped array of ``dtype``, with the
    kernel's read-ahead off for it: a window is a few pages, and read-ahead would map about a
    MiB around every page touched into the rank's resident set."""
    if path.stat().st_size <= offset:
        return np.zeros(0, dtype=dtype)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mm, "madvise"):
        mm.madvise(mmap.MADV_RANDOM)
    return np.frombuffer(mm, dtype=dtype, count=count, offset=offset)


def _mapping(a: np.ndarray | None) -> tuple[mmap.mmap, int] | None:
    """The mmap under an array of :func:`map_file`, and the array's byte offset in it."""
    view = getattr(a, "base", None)
    if not (isinstance(view, memoryview) and isinstance(view.obj, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED")):
        return None
    return view.obj, a.ctypes.data - np.frombuffer(view, dtype=np.uint8).ctypes.data


def _dont_need(mm: mmap.mmap, start: int, size: int) -> None:
    # whole fault-around blocks: the kernel maps the cached pages around a faulting one
    first = start // AROUND * AROUND
    end = min(-(-(start + size) // AROUND) * AROUND, len(mm))
    mm.madvise(mmap.MADV_DONTNEED, first, end - first)


def unmap(a: np.ndarray, lo: int, n: int) -> None:
    """Drop items ``[lo, lo + n)`` of ``a`` -- a contiguous array of :func:`map_file`, or a
    view into one -- from this process's resident set again (the pages stay in the page
    cache): what a pass over a large map read does not stay counted against the rank."""
    root = a
    while isinstance(root.base, np.ndarray):
        root = root.base
    found = _mapping(root)
    if found is not None and n > 0:
        mm, base = found
        _dont_need(mm, base + (a.ctypes.data - root.ctypes.data) + lo * a.itemsize, n * a.itemsize)


def _mmap_of(a: np.ndarray | None) -> mmap.mmap | None:
    """The mmap an array of :func:`map_file` (or a view of one) reads, else None."""
    while isinstance(a, np.ndarray):
        a = a.base
    return a.obj if isinstance(a, memoryview) and isinstance(a.obj, mmap.mmap) else None


class Pieces:
    """Arrays read as one stream (a store's shards; a single file is one piece). What a read
    mapped is unmapped from the process again once copied (``MADV_DONTNEED``: the pages stay
    in the page cache), so a rank's resident set does not grow with what it has read."""

    def __init__(self, arrays: list[np.ndarray | None], sizes: list[int] | None = None):
        self.arrays = arrays
        self.maps = [_mapping(a) for a in arrays]
        sizes = sizes if sizes is not None else [len(a) for a in arrays]
        self.offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])  # one per piece

    def _release(self, i: int, lo: int, n: int) -> None:
        if self.maps[i] is not None and n > 0:
            mm, base = self.maps[i]
            item = self.arrays[i].itemsize
            _dont_need(mm, base + lo * item, n * item)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def read(self, start: int, n: int, fill: int = 0) -> np.ndarray:
        """A copy of items ``[start, start + n)``; a piece without an array reads ``fill``."""
        out, at = [], start
        i = int(np.searchsorted(self.offsets, start, side="right")) - 1
        while at < start + n:
            lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
            take = min(hi, start + n) - at
            a = self.arrays[i]
            out.append(np.full(take, fill, dtype=np.int64) if a is None
                       else np.asarray(a[at - lo:at - lo + take], dtype=np.int64))
            self._release(i, at - lo, take)
            at += take
            i += 1
        return np.concatenate(out) if len(out) != 1 else out[0]


@dataclass
class Starts:
    """Each document's first token, per piece: sorted arrays of offsets ``scale`` times the
    token offset within the piece (Megatron's ``.idx`` stores byte offsets)."""

    pieces: list[tuple[int, np.ndarray, int]]  # (token offset of the piece, starts, scale)

    def within(self, lo: int, hi: int) -> np.ndarray:
        """Document starts ``s`` with ``lo < s < hi``, as token offsets in the stream."""
        found = []
        for base, starts, scale in self.pieces:
            if base >= hi:
                continue
            a = int(np.searchsorted(starts, (lo - base) * scale, side="right"))
            b = int(np.searchsorted(starts, (hi - base) * scale, side="left"))
            if b > a:
                found.append(base + np.asarray(starts[a:b], dtype=np.int64) // scale)
        return np.concatenate(found) if found else np.zeros(0, dtype=np.int64)


@dataclass
class TokenFile:
    """One source of token ids. ``max_token`` is known from a manifest or an index, else
    None until :func:`~tpplan.data.scan.largest_id` reads it once."""

    path: Path
    kind: str  # store | megatron | flat
    tokens: Pieces
    dtype: str
    documents: int | None = None
    starts: Starts | None = None
    mask: Pieces | None = None
    max_token: int | None = None
    min_token: int | None = None  # known once a scan read the file (stores hold no negative ids)
    tokenizer: dict | None = None  # a store's tokenizer identity
    separator: int | None = None
    loss_tokens: int | None = None
    notes: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def windows(self, seq_len: int) -> int:
        """Whole packed windows of ``seq_len`` inputs (+1 target)."""
        return max((len(self) - 1) // seq_len, 0)

    def document(self, i: int) -> np.ndarray:
        """The ids of document ``i`` (a Megatron dataset's: what its own reader returns)."""
        if self.starts is None:
            raise IndexError(f"{self.path} has no document boundaries")
        for j, (base, starts, scale) in enumerate(self.starts.pieces):
            if i < len(starts):
                lo = base + int(starts[i]) // scale
                hi = base + int(starts[i + 1]) // scale if i + 1 < len(starts) else int(self.tokens.offsets[j + 1])
                return self.tokens.read(lo, hi - lo) if hi > lo else np.zeros(0, dtype=np.int64)
            i -= len(starts)
        raise IndexError(f"{self.path} has {self.documents} documents")

    def window(self, w: int, seq_len: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """(ids ``L + 1``, loss mask over the ``L`` targets or None, positions over the
        ``L + 1`` ids restarting at each document's first token, or None)."""
        lo = w * seq_len
        ids = self.tokens.read(lo, seq_len + 1)
        mask = None if self.mask is None else self.mask.read(lo + 1, seq_len, fill=1).astype(bool)
        positions = None
        if self.starts is not None:
            index = np.arange(seq_len + 1, dtype=np.int64)
            cuts = self.starts.within(lo, lo + seq_len + 1) - lo
            last = np.concatenate([[0], cuts])[np.searchsorted(cuts, index, side="right")]
            positions = index - last
        return ids, mask, positions

    def close(self) -> None:
        """Unmap every file this source maps (ids, loss mask, document starts, a Megatron
        index): the address space goes back and the files may be deleted or rewritten. The
        source reads nothing after; a second close does nothing. A map that something else
        still views (an array taken from the source by its caller) is left to that view."""
        arrays = [*self.tokens.arrays, *(self.mask.arrays if self.mask is not None else ()),
                  *(s for _, s, _ in (self.starts.pieces if self.starts is not None else ()))]
        maps = {id(m): m for m in map(_mmap_of, arrays) if m is not None}
        self.tokens, self.mask, self.starts = Pieces([]), None, None
        del arrays  # the last views of the maps: each map's buffer is no longer exported
        for m in maps.values():
            try:
                m.close()
            except BufferError:
                pass
