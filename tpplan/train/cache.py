"""The token cache: data tokenized once per run, kept in the run folder as a token store.

``<run folder>/tokens/<role>/`` is a token store in the format ``tpplan data prepare``
writes (:mod:`tpplan.data.store`: ``tokens.json`` and its shards), made by the same code
with ``data.workers`` processes (:mod:`tpplan.train.corpora`); ``<role>.json`` beside it is
the cache's record: the *key* (every source file's path, size and SHA-256, the tokenizer's
identity, the settings) and what was made (token count, largest id, documents). A run whose
key equals the record's maps the store (every shard, read as one stream: :mod:`.joined`) and tokenizes nothing; any
difference re-makes it. The store is an ordinary one: a later run may name it as
``data.path`` (or a ``data.sources`` entry).

Every rank of a launch calls :func:`cached` before the process group exists. An exclusive
``flock`` on ``tokens/.lock`` lets one rank build (with its worker processes) while the
others wait and then find the cache made; the record is removed first and written last
(renamed into place), so a killed build never leaves a record that describes other tokens.
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
from ..data.store import MANIFEST, shard_done, shard_paths
from .joined import join

__all__ = ["CACHE_DIR", "cached", "file_digest"]

CACHE_DIR = "tokens"
VERSION = 2  # 2: a token store (1 was an int32 stream)
STARTED = time.time()  # a cache made after this was made by this launch (maybe another rank)


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    with open(folder / ".lock", "a") as fh:
        try:
            import fcntl

            fcntl.flock(fh, fcntl.LOCK_EX)
        except (ImportError, OSError):
            pass  # no flock here: ranks may each build; the renames keep that safe
        yield


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def _intact(store: Path, record: dict[str, Any]) -> bool:
    """The store holds what the record says: its manifest's count, every shard whole."""
    manifest = _read_json(store / MANIFEST)
    return (manifest is not None and manifest.get("tokens") == record.get("tokens")
            and all(shard_done(store, s["index"], manifest["dtype"]) is not None for s in manifest["shards"]))


def _map(path: Path, dtype: Any, n: int) -> torch.Tensor:
    if n == 0:
        return torch.zeros(0, dtype=torch.bool if dtype == np.bool_ else torch.int32)
    # copy-on-write: writable for torch, never written back, pages read on demand
    return torch.from_numpy(np.memmap(path, dtype=dtype, mode="c", shape=(n,)))


def cached(folder: Path, role: str, key: dict[str, Any],
           build: Callable[[Path], dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor | None, dict, bool]:
    """(tokens, mask or None where every token counts, record, reused?) for ``key``, both
    memory-mapped from the store ``folder/role`` (several shards read as one: a
    :class:`~tpplan.train.joined.Joined`); ``build(store)`` writes that store into the
    folder, which may hold an earlier store, and returns its manifest when the cache does not
    hold ``key``. Reused means made before this process started: another rank's build just
    now is not a reuse."""
    store = folder / role
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with _locked(folder):
            record = _read_json(folder / f"{role}.json")
            reused = record is not None and record.get("version") == VERSION and \
                record.get("key") == key and _intact(store, record)
            if not reused:
                record = _build(folder, role, key, build)
    except OSError as e:
        raise DataError(f"cannot write the token cache in {folder}: {e.strerror or e}") from None
    reused = reused and record.get("made_at", 0) < STARTED
    shards = (_read_json(store / MANIFEST) or {}).get("shards", [])
    ids, masks, sizes = [], [], []
    for s in shards:
        paths = shard_paths(store, s["index"])
        ids.append(_map(paths["ids"], np.dtype(record["dtype"]), s["tokens"]))
        masks.append(_map(paths["mask"], np.bool_, s["tokens"]) if s["masked"] else None)
        sizes.append(s["tokens"])
    tokens = join(ids, sizes, ids[0].dtype if ids else torch.int32)
    mask = join(masks, sizes, torch.bool, fill=1) if record["masked"] else None
    return tokens, mask, record, reused


def _build(folder: Path, role: str, key: dict[str, Any], build: Callable[[Path], dict[str, Any]]) -> dict:
    (folder / f"{role}.json").unlink(missing_ok=True)  # no record over a store being remade
    store = folder / role
    store.mkdir(parents=True, exist_ok=True)  # the builder replaces (or continues) what it holds
    manifest = build(store)
    record = {"version": VERSION, "key": key, "made_at": time.time(), "store": str(store),
              "shards": len(manifest["shards"]),
              **{k: manifest[k] for k in ("tokens", "documents", "max_token", "loss_tokens", "masked", "dtype")}}
    tmp = folder / f"{role}.json.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, folder / f"{role}.json")
    return record
