"""The shards of a token store read as one 1-D tensor, without copying them.

The per-run token cache is a token store of one or more shards (:mod:`.cache`); the trainer's
:class:`~tpplan.train.data.Corpus` reads its ids and loss mask as one stream: its length,
slices (a held-out split) and a gather of windows (``tokens[index]``). One shard is its
memory-mapped tensor itself; several are a :class:`Joined` over their maps, so a corpus of
many shards costs a rank the pages its windows touch, never a copy of the corpus.
"""

from __future__ import annotations

import torch

__all__ = ["Joined", "join"]


class Joined:
    """1-D tensors (``None``: a stretch of ``fill``, as a shard without a mask, every token a
    target) read as one: ``numel``, ``len``, slices (a view over the same maps) and indexing
    by an integer tensor of any shape (a gather; ids come back int64, masks bool)."""

    def __init__(self, parts: list[torch.Tensor | None], sizes: list[int], dtype: torch.dtype, fill: int = 0):
        self.parts, self.sizes, self.dtype, self.fill = parts, sizes, dtype, fill
        self.offsets = torch.cumsum(torch.tensor([0, *sizes], dtype=torch.int64), 0)

    def numel(self) -> int:
        return int(self.offsets[-1])

    def __len__(self) -> int:
        return self.numel()

    def _part(self, i: int, lo: int, hi: int) -> torch.Tensor | None:
        part = self.parts[i]
        return None if part is None else part[lo:hi]

    def __getitem__(self, key: slice | torch.Tensor | int) -> Joined | torch.Tensor:
        if isinstance(key, slice):
            lo, hi, step = key.indices(len(self))
            if step != 1:
                raise IndexError("a Joined tensor slices with step 1 only")
            parts, sizes = [], []
            for i in range(len(self.parts)):
                a, b = int(self.offsets[i]), int(self.offsets[i + 1])
                if b > lo and a < hi:
                    parts.append(self._part(i, max(lo, a) - a, min(hi, b) - a))
                    sizes.append(min(hi, b) - max(lo, a))
            return Joined(parts, sizes, self.dtype, self.fill)
        index = torch.as_tensor(key, dtype=torch.int64)
        flat = index.reshape(-1)
        if len(flat) and (int(flat.min()) < 0 or int(flat.max()) >= len(self)):
            raise IndexError(f"index out of range for {len(self)} items")
        out_dtype = torch.bool if self.dtype == torch.bool else torch.int64
        out = torch.full(flat.shape, self.fill, dtype=out_dtype)
        piece = torch.searchsorted(self.offsets[1:], flat, right=True)
        for i in piece.unique().tolist():
            if self.parts[i] is not None:
                at = piece == i
                out[at] = self.parts[i][flat[at] - self.offsets[i]].to(out_dtype)
        return out.reshape(index.shape)

    def sum(self) -> torch.Tensor:
        return sum((p.sum(dtype=torch.int64) if p is not None else torch.tensor(self.fill * n)
                    for p, n in zip(self.parts, self.sizes)), torch.tensor(0, dtype=torch.int64))

    def tolist(self) -> list:
        """Every item (for tests and small corpora: this one reads the whole stream)."""
        return self[torch.arange(len(self))].tolist()


def join(parts: list[torch.Tensor | None], sizes: list[int], dtype: torch.dtype,
         fill: int = 0) -> torch.Tensor | Joined:
    """One shard: its tensor (``None``: ``fill`` materialised, one byte a token); several: a
    :class:`Joined` over them."""
    if len(parts) == 1:
        return parts[0] if parts[0] is not None else torch.full((sizes[0],), fill, dtype=dtype)
    return Joined(parts, sizes, dtype, fill)
