"""Checks a token source needs before any process group: ids inside the model's vocabulary,
the tokenizer the store was made with, something to read at all.

A store's manifest knows its largest id; a flat file or a Megatron ``.bin`` is read once, a
few MiB at a time with plain reads (not through the map, so the scan leaves no pages
resident), and the answer is kept under ``~/.cache/tpplan`` (``TPPLAN_CACHE``) keyed by the
file's path, size and modification time: the next launch pays a ``stat``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from .errors import DataError
from .tokenfile import TokenFile

__all__ = ["CHUNK", "cache_dir", "check_source", "largest_id"]

CHUNK = 1 << 24  # bytes read at a time


def cache_dir() -> Path:
    return Path(os.environ.get("TPPLAN_CACHE") or Path.home() / ".cache" / "tpplan")


def _scan(path: Path, dtype: str) -> list[int]:
    """[largest, smallest] id of the file (``[-1, 0]`` when empty)."""
    item = np.dtype(dtype).itemsize
    buf = np.empty(CHUNK // item, dtype=dtype)
    top, bottom = -1, 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(memoryview(buf).cast("B")):
            top = max(top, int(buf[:n // item].max()))
            bottom = min(bottom, int(buf[:n // item].min()))
    return [top, bottom]


def largest_id(tf: TokenFile) -> int:
    """The largest id in ``tf`` (-1 when empty); scanned once per file version."""
    if tf.max_token is not None:
        return tf.max_token
    st = tf.path.stat()
    key = f"{tf.path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{tf.dtype}"
    cache = cache_dir() / "largest-ids.json"
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    low = f"{key}:min" if np.dtype(tf.dtype).kind == "i" else None  # a signed dtype: its smallest id too
    if key not in known or (low is not None and low not in known):
        known[key], smallest = _scan(tf.path, tf.dtype)
        if low is not None:
            known[low] = smallest
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_name(f"{cache.name}.{os.getpid()}")
            tmp.write_text(json.dumps(known))
            os.replace(tmp, cache)
        except OSError:
            pass  # a read-only home: scan again next time
    tf.max_token, tf.min_token = int(known[key]), int(known.get(low, 0))
    return tf.max_token


def check_source(tf: TokenFile, vocab: int | None, tokenizer: str | None, seq_len: int) -> None:
    """Raise a one-line :class:`DataError` naming ``tf``'s file for what would make training on
    it wrong: too few tokens for one window, an id past the vocabulary, another tokenizer."""
    if len(tf) < seq_len + 2:
        raise DataError(f"{tf.path}: {len(tf)} tokens, fewer than one sequence of {seq_len} + 1 "
                        f"(an empty or nearly empty source)")
    if tokenizer is not None and tf.tokenizer is not None and tf.tokenizer.get("identity") != tokenizer:
        raise DataError(f"{tf.path}: made with another tokenizer ({tf.tokenizer.get('name')}, "
                        f"sha256 {str(tf.tokenizer.get('identity'))[:12]}) than data.tokenizer "
                        f"(sha256 {tokenizer[:12]}): its ids mean other tokens")
    top = largest_id(tf)
    if (tf.min_token or 0) < 0:  # a signed dtype (int32, a Megatron int16/int64): no id is negative
        raise DataError(f"{tf.path}: holds token id {tf.min_token}, a negative id (the wrong data.dtype, "
                        f"or not a file of token ids?)")
    if vocab is not None and top >= vocab:
        raise DataError(f"{tf.path}: holds token id {top}, past the model's vocabulary of {vocab} "
                        f"(a corpus tokenized for another model, or the wrong data.dtype?)")
