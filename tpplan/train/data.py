"""Tokens for training: byte-level text (vocabulary 256), pre-tokenized uint16 ``.bin``, or
text and chats tokenized with a real tokenizer (:mod:`.corpora`).

The default corpus needs no download and exists wherever Python does: the standard
library's own ``.py`` sources, read in sorted order up to ``data.max_bytes``.

Batches are a pure function of ``(seed, step, dp_rank)``: the global batch of a step is
``global_batch_size`` windows chosen by a generator seeded by the run seed and the step,
and each data-parallel rank takes its contiguous slice. So every TP peer (same dp rank)
gets the identical batch, any mesh shape sees the same global batch, and the data position
in a checkpoint is just the number of steps consumed.

Bytes and ``.bin`` draw windows at random offsets. Tokenized data is *packed*: documents
end to end, a separator token between them, cut into consecutive windows of ``seq_len``
inputs (each window's last target is the next window's first input); every epoch visits
each window once, in an order drawn from the seed and the epoch. There is no padding: the
tokens after the last whole window are left out, so no window ever runs past the data.
A tokenized corpus may carry a loss mask (chat: only the assistant's tokens count).
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..data.batch import Batch
from ..data.errors import DataError
from ..data.files import BINARY_PROBE, text_files

__all__ = ["Batch", "Corpus", "CorpusFeed", "DataError", "eval_batch", "global_batch", "load_corpus",
           "local_batch", "step_batch", "stdlib_dir"]

def stdlib_dir() -> Path:
    """The running interpreter's standard library source folder."""
    return Path(sysconfig.get_paths()["stdlib"])


@dataclass
class Corpus:
    tokens: torch.Tensor  # 1-D integer (int64, or int32 memory-mapped from the cache)
    vocab_size: int  # smallest vocabulary that covers the tokens' alphabet
    source: str
    # 1-D bool: token i counts in the loss as a target (chat: the assistant's); None: all do
    mask: torch.Tensor | None = None
    packed: bool = False  # consecutive windows (tokenized data), not random offsets
    separator: int | None = None  # the token that ends each packed document

    def __len__(self) -> int:
        return self.tokens.numel()

    def windows(self, seq_len: int) -> int:
        """How many whole packed windows of ``seq_len`` inputs (+1 target) it holds."""
        return max((len(self) - 1) // seq_len, 0)

    def split(self, fraction: float, seq_len: int) -> tuple["Corpus", "Corpus"]:
        """(training, held-out): the last ``fraction`` of the windows held out, cut at a
        window boundary so no window is in both."""
        n = self.windows(seq_len)
        held = max(1, round(n * fraction)) if n else 0
        cut = (n - held) * seq_len
        part = (lambda lo, hi: None) if self.mask is None else (lambda lo, hi: self.mask[lo:hi])
        train = Corpus(self.tokens[:cut + 1], self.vocab_size, self.source, part(0, cut + 1),
                       self.packed, self.separator)
        held_out = Corpus(self.tokens[cut:], self.vocab_size,
                          f"last {fraction:g} of {self.source}", part(cut, None), True,
                          self.separator)
        return train, held_out


def document_positions(tokens: torch.Tensor, separator: int | None) -> torch.Tensor | None:
    """(b, s) positions restarting at 0 after each ``separator`` (the token that ends a
    packed document), so the model masks documents from each other (``data.document_mask``);
    None without a separator (bytes and ``.bin`` data have no document boundaries)."""
    if separator is None:
        return None
    ends = tokens == separator
    starts = torch.zeros_like(ends)
    starts[:, 1:] = ends[:, :-1]
    index = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    last_start = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - last_start


def _read_bytes(files: Iterable[Path], max_bytes: int) -> bytes:
    """Text of ``files`` in order, up to ``max_bytes`` in all; binary files skipped. Reads
    no more of a file than the cap still needs (and its first KiB to tell binary from
    text), so a 600 MB file under a 4 MB cap costs 4 MB, not 600."""
    chunks, total = [], 0
    for f in files:
        left = max_bytes - total
        try:
            with open(f, "rb") as fh:
                head = fh.read(BINARY_PROBE)
                if b"\0" in head:  # binary file in a text folder
                    continue
                data = head[:left]
                if len(head) < left:
                    data += fh.read(left - len(head))
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(chunks)


def load_corpus(path: str | None, max_bytes: int) -> Corpus:
    """Read ``path`` (text file, folder of text files, ``.bin`` of uint16) or the stdlib."""
    if path is None:
        folder = stdlib_dir()
        raw = _read_bytes(text_files(folder, ".py"), max_bytes)
        return Corpus(_bytes_to_tokens(raw), 256, f"python stdlib ({folder})")
    p = Path(path)
    if p.suffix == ".bin":
        arr = np.fromfile(p, dtype=np.uint16, count=max_bytes // 2)
        tokens = torch.from_numpy(arr.astype(np.int64))
        vocab = int(tokens.max()) + 1 if tokens.numel() else 0
        return Corpus(tokens, vocab, f"{p} (uint16 tokens)")
    raw = _read_bytes(text_files(p) if p.is_dir() else [p], max_bytes)
    return Corpus(_bytes_to_tokens(raw), 256, str(p))


def _bytes_to_tokens(raw: bytes) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).astype(np.int64))


def _starts(corpus: Corpus, seed: int, step: int, batch: int, seq_len: int) -> torch.Tensor:
    """First token of each window of step ``step``'s global batch."""
    if not corpus.packed:
        span = len(corpus) - seq_len - 1
        g = torch.Generator().manual_seed(_mix(seed, step))
        return torch.randint(0, span + 1, (batch,), generator=g)
    n = corpus.windows(seq_len)
    k = (step - 1) * batch + torch.arange(batch)  # window draws so far, over all epochs
    epoch, pos = k // n, k % n
    order = {int(e): torch.randperm(n, generator=torch.Generator().manual_seed(
        _mix(seed, -1 - int(e)))) for e in epoch.unique()}
    return torch.stack([order[int(e)][int(p)] for e, p in zip(epoch, pos)]) * seq_len


def _take(corpus: Corpus, starts: torch.Tensor, seq_len: int):
    idx = starts[:, None] + torch.arange(seq_len + 1)
    mask = None if corpus.mask is None else corpus.mask[idx[:, 1:]]
    return corpus.tokens[idx].long(), mask


def global_batch(corpus: Corpus, seed: int, step: int, batch: int, seq_len: int) -> torch.Tensor:
    """(batch, seq_len + 1) windows of step ``step``: inputs ``[:, :-1]``, targets ``[:, 1:]``."""
    return _take(corpus, _starts(corpus, seed, step, batch, seq_len), seq_len)[0]


def local_batch(corpus: Corpus, seed: int, step: int, batch: int, seq_len: int,
                dp_rank: int, dp: int) -> torch.Tensor:
    """This data-parallel rank's contiguous slice of the step's global batch."""
    full = global_batch(corpus, seed, step, batch, seq_len)
    per = batch // dp
    return full[dp_rank * per:(dp_rank + 1) * per]


def _share(corpus: Corpus, starts: torch.Tensor, seq_len: int, dp_rank: int, dp: int) -> Batch:
    tokens, mask = _take(corpus, starts, seq_len)
    count = tokens[:, 1:].numel() if mask is None else int(mask.sum())
    per = len(starts) // dp
    part = slice(dp_rank * per, (dp_rank + 1) * per)
    return Batch(tokens[part], None if mask is None else mask[part], count)


def step_batch(corpus: Corpus, seed: int, step: int, batch: int, seq_len: int,
               dp_rank: int, dp: int) -> Batch:
    """This rank's slice of step ``step``'s global batch, with its loss mask and the global
    batch's count of loss targets (the same on every rank: no collective needed)."""
    return _share(corpus, _starts(corpus, seed, step, batch, seq_len), seq_len, dp_rank, dp)


def eval_batch(corpus: Corpus, index: int, batch: int, seq_len: int, dp_rank: int,
               dp: int) -> Batch:
    """The ``index``-th global batch of held-out windows, in order (every evaluation sees the
    same ones)."""
    starts = (index * batch + torch.arange(batch)) * seq_len
    return _share(corpus, starts, seq_len, dp_rank, dp)


class CorpusFeed:
    """A corpus read whole (bytes, text tokenized into the run's cache) served like a
    :class:`~tpplan.data.feed.TokenFeed`: ``batch(step, dp_rank, dp)``."""

    def __init__(self, corpus: Corpus, seed: int, batch: int, seq_len: int):
        self.corpus, self.seed, self.global_batch, self.seq_len = corpus, seed, batch, seq_len
        self.separator, self.source = corpus.separator, corpus.source

    def __len__(self) -> int:
        return len(self.corpus)

    def batch(self, step: int, dp_rank: int, dp: int, global_batch: int | None = None) -> Batch:
        return step_batch(self.corpus, self.seed, step, global_batch or self.global_batch, self.seq_len,
                          dp_rank, dp)

    def metrics(self, step: int, note: Callable[[str], None] | None = None) -> dict:
        return {}

    def summary(self, steps: int) -> dict:
        return {}

    def close(self) -> None:
        pass


def _mix(seed: int, step: int) -> int:
    digest = hashlib.sha256(f"data:{seed}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
