"""Walking a folder of data files the same way on every rank and run, and hashing them."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["BINARY_PROBE", "SKIP_DIRS", "file_digest", "text_files"]

SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idlelib"}
BINARY_PROBE = 1024  # a NUL in a file's first KiB marks it binary


def text_files(folder: Path, suffix: str | None = None) -> Iterator[Path]:
    """Files under ``folder`` in sorted order (the same corpus on every rank and run),
    lazily, pruning skipped folders, so a capped read stops walking early."""
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        for name in sorted(files):
            if suffix is None or name.endswith(suffix):
                yield Path(root) / name


def file_digest(path: Path) -> str:
    """SHA-256 of a file, read a MiB at a time (never held whole)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
