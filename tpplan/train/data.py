"""Tokens for training: byte-level text (vocabulary 256) or pre-tokenized uint16 ``.bin``.

The default corpus needs no download and exists wherever Python does: the standard
library's own ``.py`` sources, read in sorted order up to ``data.max_bytes``.

Batches are a pure function of ``(seed, step, dp_rank)``: the global batch of a step is
``global_batch_size`` windows at offsets drawn from a generator seeded by the run seed and
the step, and each data-parallel rank takes its contiguous slice. So every TP peer (same
dp rank) gets the identical batch, any mesh shape sees the same global batch, and the data
position in a checkpoint is just the number of steps consumed.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = ["Corpus", "global_batch", "load_corpus", "local_batch", "stdlib_dir"]

SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idlelib"}


def stdlib_dir() -> Path:
    """The running interpreter's standard library source folder."""
    return Path(sysconfig.get_paths()["stdlib"])


@dataclass
class Corpus:
    tokens: torch.Tensor  # 1-D int64
    vocab_size: int  # smallest vocabulary that covers the tokens' alphabet
    source: str

    def __len__(self) -> int:
        return self.tokens.numel()


def _text_files(folder: Path, suffix: str | None = None) -> Iterator[Path]:
    """Files under ``folder`` in sorted order (the same corpus on every rank and run),
    lazily, pruning skipped folders, so a capped read stops walking early."""
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        for name in sorted(files):
            if suffix is None or name.endswith(suffix):
                yield Path(root) / name


BINARY_PROBE = 1024  # a NUL in a file's first KiB marks it binary


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
        raw = _read_bytes(_text_files(folder, ".py"), max_bytes)
        return Corpus(_bytes_to_tokens(raw), 256, f"python stdlib ({folder})")
    p = Path(path)
    if p.suffix == ".bin":
        arr = np.fromfile(p, dtype=np.uint16, count=max_bytes // 2)
        tokens = torch.from_numpy(arr.astype(np.int64))
        vocab = int(tokens.max()) + 1 if tokens.numel() else 0
        return Corpus(tokens, vocab, f"{p} (uint16 tokens)")
    raw = _read_bytes(_text_files(p) if p.is_dir() else [p], max_bytes)
    return Corpus(_bytes_to_tokens(raw), 256, str(p))


def _bytes_to_tokens(raw: bytes) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).astype(np.int64))


def global_batch(corpus: Corpus, seed: int, step: int, batch: int, seq_len: int) -> torch.Tensor:
    """(batch, seq_len + 1) windows of step ``step``: inputs ``[:, :-1]``, targets ``[:, 1:]``."""
    span = len(corpus) - seq_len - 1
    g = torch.Generator().manual_seed(_mix(seed, step))
    starts = torch.randint(0, span + 1, (batch,), generator=g)
    idx = starts[:, None] + torch.arange(seq_len + 1)
    return corpus.tokens[idx]


def local_batch(corpus: Corpus, seed: int, step: int, batch: int, seq_len: int,
                dp_rank: int, dp: int) -> torch.Tensor:
    """This data-parallel rank's contiguous slice of the step's global batch."""
    full = global_batch(corpus, seed, step, batch, seq_len)
    per = batch // dp
    return full[dp_rank * per:(dp_rank + 1) * per]


def _mix(seed: int, step: int) -> int:
    digest = hashlib.sha256(f"data:{seed}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
