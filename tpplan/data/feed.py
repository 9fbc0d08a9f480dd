"""The training data of a run on token sources: a mixture drawn by weight, gathered from
memory maps one step ahead in a background thread.

Step ``s``'s global batch is a pure function of (seed, step) (:mod:`.order`): each sample's
source by weight, its window by a per-epoch permutation of that source's windows. Each
data-parallel rank reads only its contiguous slice; the loss normaliser (the global batch's
counted targets) needs every window's mask only when some source has one. A source whose
windows run out starts another epoch in a new order (it *wraps*): the run says so.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from .batch import Batch
from .order import consumed, key_of, permute, route
from .tokenfile import TokenFile

__all__ = ["HeldOut", "Source", "TokenFeed"]

AHEAD = 2  # steps gathered ahead of the one training


@dataclass
class Source:
    name: str
    file: TokenFile
    weight: float


class TokenFeed:
    """``batch(step, dp_rank, dp)``: this rank's share of the step's global batch."""

    separator = None  # positions come from the sources' document starts

    def __init__(self, sources: list[Source], seed: int, batch: int, seq_len: int, ahead: int = AHEAD):
        self.sources, self.seed, self.global_batch, self.seq_len = sources, seed, batch, seq_len
        self.weights = [s.weight for s in sources]
        self.windows = [s.file.windows(seq_len) for s in sources]
        self.masked = any(s.file.mask is not None for s in sources)
        self.ahead = ahead
        self.held_out: HeldOut | None = None  # eval.path: the held-out windows, read in order
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[tuple[int, int, int, int], Future] = {}
        self._lock = threading.Lock()
        self._closed = False

    @property
    def source(self) -> str:
        return ", ".join(f"{s.name} ({s.file.kind} {s.file.path})" for s in self.sources)

    def __len__(self) -> int:
        return sum(len(s.file) for s in self.sources)

    def draw(self, step: int, batch: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(source, window) of each sample of step ``step``'s global batch (of ``batch``)."""
        batch = batch or self.global_batch
        k = (step - 1) * batch + np.arange(batch, dtype=np.int64)
        src, ordinal = route(k, self.weights)
        window = np.zeros_like(ordinal)
        for s in np.unique(src):
            n = self.windows[s]
            at = src == s
            epoch, pos = ordinal[at] // n, ordinal[at] % n
            out = np.empty_like(pos)
            for e in np.unique(epoch):
                here = epoch == e
                out[here] = permute(pos[here], n, key_of(self.seed, int(s), int(e)))
            window[at] = out
        return src, window

    def _make(self, step: int, dp_rank: int, dp: int, batch: int) -> Batch:
        src, window = self.draw(step, batch)
        per = batch // dp
        part = range(dp_rank * per, (dp_rank + 1) * per)
        reads = [self.sources[src[i]].file.window(int(window[i]), self.seq_len) for i in part]
        tokens = torch.from_numpy(np.stack([r[0] for r in reads]))
        L = self.seq_len
        positions = torch.from_numpy(np.stack([r[2] if r[2] is not None else np.arange(L + 1)
                                               for r in reads]))
        if not self.masked:
            return Batch(tokens, None, batch * L, positions)
        mask = torch.from_numpy(np.stack([r[1] if r[1] is not None else np.ones(L, dtype=bool)
                                          for r in reads]))
        count = 0
        for i in range(batch):  # the normaliser: every rank counts the global batch
            f = self.sources[src[i]].file
            count += L if f.mask is None else int(f.mask.read(int(window[i]) * L + 1, L, fill=1).sum())
        return Batch(tokens, mask, count, positions)

    def batch(self, step: int, dp_rank: int, dp: int, global_batch: int | None = None) -> Batch:
        """Step ``step``'s share for this rank (of a global batch of ``global_batch``, default
        the plan's); the next steps' are gathered meanwhile in a background thread."""
        b = global_batch or self.global_batch
        with self._lock:
            if self._closed:
                raise RuntimeError("the token feed is closed: its sources are unmapped")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="tpplan-data")
            fut = self._pending.pop((step, dp_rank, dp, b), None)
            for ahead in range(step + 1, step + 1 + self.ahead):
                if (ahead, dp_rank, dp, b) not in self._pending:
                    self._pending[(ahead, dp_rank, dp, b)] = self._pool.submit(self._make, ahead, dp_rank, dp, b)
            for old in [k for k in self._pending if k[0] < step]:
                self._pending.pop(old).cancel()
        return fut.result() if fut is not None else self._make(step, dp_rank, dp, b)

    def close(self) -> None:
        """Stop the background reads (the one running finishes), then unmap every source and
        the held-out one. Idempotent; the feed serves no batch after."""
        with self._lock:
            pool, self._pool, self._closed = self._pool, None, True
            self._pending.clear()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        for f in [s.file for s in self.sources] + ([self.held_out.file] if self.held_out is not None else []):
            f.close()

    def used(self, steps: int) -> list[tuple[int, float]]:
        """(tokens, epochs) each source has given after ``steps`` steps."""
        counts = consumed(steps * self.global_batch, self.weights)
        return [(c * self.seq_len, c / n if n else 0.0) for c, n in zip(counts, self.windows)]

    def metrics(self, step: int, note: Callable[[str], None] | None = None) -> dict[str, float]:
        """Per source: tokens consumed so far and epochs (for metrics.jsonl); each source that
        wrapped in this step said through ``note``."""
        for line in self.wraps(step) if note is not None else []:
            note(line)
        row: dict[str, float] = {}
        for s, (tokens, epochs) in zip(self.sources, self.used(step)):
            row[f"data/{s.name}/tokens"] = tokens
            row[f"data/{s.name}/epochs"] = round(epochs, 6)
        return row

    def summary(self, steps: int) -> dict[str, str]:
        """The summary table's rows: each source's tokens read and epochs after ``steps``."""
        return {f"data {s.name}": f"{tokens:,} tokens read of {len(s.file):,} ({epochs:.3g} epochs"
                f"{', wrapped' if epochs > 1 else ''})" for s, (tokens, epochs) in zip(self.sources, self.used(steps))}

    def wraps(self, step: int) -> list[str]:
        """A note for each source that began another epoch in step ``step``."""
        before, after = self.used(step - 1), self.used(step)
        return [f"data: source {s.name} ran out of windows and wraps: epoch {int(a[1]) + 1} "
                f"(step {step}, a new order)" for s, b, a in zip(self.sources, before, after)
                if int(a[1] - 1e-9) > int(b[1] - 1e-9) and a[1] > 1]

    def plan_lines(self, steps: int) -> list[str]:
        """What the run will eat: tokens available, consumed and epochs per source."""
        total = steps * self.global_batch * self.seq_len
        lines = [f"data: the run consumes {steps} steps × {self.global_batch} × {self.seq_len} = "
                 f"{total:,} tokens"]
        for s, n, (tokens, epochs) in zip(self.sources, self.windows, self.used(steps)):
            wrap = f", wraps {int(np.ceil(epochs)) - 1} time(s)" if epochs > 1 else ""
            lines.append(f"data: {s.name}: {len(s.file):,} tokens ({n:,} windows) in {s.file.path} "
                         f"({s.file.kind}, {s.file.dtype}), weight {s.weight:g}: reads {tokens:,} "
                         f"tokens = {epochs:.3g} epochs{wrap}")
        if self.held_out is not None:
            f = self.held_out.file
            lines.append(f"data: eval: {len(f):,} tokens ({f.windows(self.seq_len):,} windows) in {f.path} "
                         f"({f.kind}, {f.dtype}), read in order from its first window")
        return lines


class _InOrder(TokenFeed):
    """One source's windows in order: step ``s`` reads windows ``(s-1)·B … s·B - 1``."""

    def draw(self, step: int, batch: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        batch = batch or self.global_batch
        return np.zeros(batch, dtype=np.int64), (step - 1) * batch + np.arange(batch, dtype=np.int64)

    def gather(self, step: int, dp_rank: int, dp: int, batch: int) -> Batch:
        return self._make(step, dp_rank, dp, batch)


class HeldOut:
    """A held-out token source (``eval.path``) read in order: evaluation batch ``i`` is windows
    ``i·B … (i+1)·B - 1`` (``B`` the global batch), each rank its contiguous slice, so every
    evaluation on any mesh sees the same windows and the same count of targets."""

    separator = None  # positions come from the source's document starts

    def __init__(self, name: str, file: TokenFile, seq_len: int):
        self.file, self.seq_len = file, seq_len
        self._feed = _InOrder([Source(name, file, 1.0)], 0, 1, seq_len, ahead=0)

    @property
    def source(self) -> str:
        return self._feed.source

    def windows(self, seq_len: int) -> int:
        return self.file.windows(seq_len)

    def eval_batch(self, index: int, batch: int, seq_len: int, dp_rank: int, dp: int) -> Batch:
        """Evaluation batch ``index`` (from 0) of ``batch`` windows: this rank's share."""
        if (index + 1) * batch > self.windows(seq_len) or seq_len != self.seq_len:
            raise IndexError(f"{self.file.path}: evaluation batch {index} of {batch} windows of {seq_len} "
                             f"is past its {self.windows(self.seq_len)} windows of {self.seq_len}")
        return self._feed.gather(index + 1, dp_rank, dp, batch)
