"""The token cache: data tokenized once, kept in the run folder, memory-mapped.

``<run folder>/tokens/<role>.tokens`` (int32) and ``<role>.mask`` (one byte a token: 1 where
the loss counts it as a target) hold the packed stream; ``<role>.json`` is the manifest: the
*key* (every source file's path, size and SHA-256, the tokenizer's identity, the settings)
and what was made (token count, largest id, documents). A run whose key equals the
manifest's maps the arrays and tokenizes nothing; any difference re-makes them.

Every rank of a launch calls :func:`cached` before the process group exists. An exclusive
``flock`` on ``tokens/.lock`` lets one rank build while the others wait and then find the
cache made; the arrays are written to temporary names and renamed into place, manifest
last, so a killed build never leaves a manifest that describes other tokens.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..data.errors import DataError
from ..data.files import file_digest

__all__ = ["CACHE_DIR", "Made", "cached", "file_digest"]

CACHE_DIR = "tokens"
VERSION = 1
STARTED = time.time()  # a cache made after this was made by this launch (maybe another rank)


class Made:
    """A build in progress: appends tokens and masks to the temporary files."""

    def __init__(self, tokens, mask):
        self._tokens, self._mask = tokens, mask
        self.count = self.documents = self.max_token = self.loss_tokens = 0
        self.masked = False  # some document's tokens do not all count (chat)

    def add(self, ids: list[int], mask: list[bool]) -> None:
        if not ids:
            return
        a = np.asarray(ids, dtype=np.int32)
        m = np.asarray(mask, dtype=np.uint8)
        self._tokens.write(a.tobytes())
        self._mask.write(m.tobytes())
        self.count += len(a)
        self.max_token = max(self.max_token, int(a.max()))
        self.loss_tokens += int(m.sum())
        self.masked = self.masked or not bool(m.all())


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    with open(folder / ".lock", "a") as fh:
        try:
            import fcntl

            fcntl.flock(fh, fcntl.LOCK_EX)
        except (ImportError, OSError):
            pass  # no flock here: ranks may each build; the renames keep that safe
        yield


def _read_manifest(path: Path) -> dict[str, Any] | None:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def _intact(folder: Path, role: str, manifest: dict[str, Any]) -> bool:
    n = manifest.get("tokens")
    try:
        return (isinstance(n, int) and (folder / f"{role}.tokens").stat().st_size == 4 * n
                and (folder / f"{role}.mask").stat().st_size == n)
    except OSError:
        return False


def _map(path: Path, dtype, n: int) -> torch.Tensor:
    if n == 0:
        return torch.zeros(0, dtype=torch.int32 if dtype == np.int32 else torch.bool)
    # copy-on-write: writable for torch, never written back, pages read on demand
    return torch.from_numpy(np.memmap(path, dtype=dtype, mode="c", shape=(n,)))


def cached(folder: Path, role: str, key: dict[str, Any],
           build: Callable[[Made], None]) -> tuple[torch.Tensor, torch.Tensor | None, dict, bool]:
    """(tokens, mask or None where every token counts, manifest, reused?) for ``key``;
    ``build(made)`` is called to tokenize when the cache does not hold ``key``. Reused means
    made before this process started: another rank's build just now is not a reuse."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with _locked(folder):
            manifest = _read_manifest(folder / f"{role}.json")
            reused = manifest is not None and manifest.get("key") == key and \
                _intact(folder, role, manifest)
            if not reused:
                manifest = _build(folder, role, key, build)
    except OSError as e:
        raise DataError(f"cannot write the token cache in {folder}: "
                        f"{e.strerror or e}") from None
    reused = reused and manifest.get("made_at", 0) < STARTED
    n = manifest["tokens"]
    tokens = _map(folder / f"{role}.tokens", np.int32, n)
    mask = _map(folder / f"{role}.mask", np.bool_, n) if manifest["masked"] else None
    return tokens, mask, manifest, reused


def _build(folder: Path, role: str, key: dict[str, Any], build: Callable[[Made], None]) -> dict:
    tmp = {ext: folder / f"{role}.{ext}.tmp-{os.getpid()}" for ext in ("tokens", "mask", "json")}
    try:
        with open(tmp["tokens"], "wb") as t, open(tmp["mask"], "wb") as m:
            made = Made(t, m)
            build(made)
        manifest = {"version": VERSION, "key": key, "made_at": time.time(), "tokens": made.count,
                    "documents": made.documents, "max_token": made.max_token,
                    "loss_tokens": made.loss_tokens, "masked": made.masked}
        tmp["json"].write_text(json.dumps(manifest, indent=1) + "\n")
        (folder / f"{role}.json").unlink(missing_ok=True)  # no manifest over mixed arrays
        for ext in ("tokens", "mask", "json"):
            os.replace(tmp[ext], folder / f"{role}.{ext}")
    finally:
        for p in tmp.values():
            p.unlink(missing_ok=True)
    return manifest
