"""tpplan's token store: a folder of shards that ``tpplan data prepare`` writes and the
trainer memory-maps.

::

    corpus/
      tokens.json          the manifest: tokenizer identity, dtype, counts, each shard
      shards/00000.ids     token ids in the narrowest dtype the vocabulary allows
      shards/00000.docs    int64: each document's first token, within the shard
      shards/00000.mask    uint8 (only where some token is not a loss target: chats)
      shards/00000.json    the shard's counts and SHA-256s, written last: the shard is done

Each document is followed by the separator token (the model learns where documents end);
in a chat the separator is not a loss target. A shard is written under temporary names and
renamed into place, its ``.json`` last, so a killed ``prepare`` leaves whole shards or none.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from .errors import DataError
from .files import file_digest
from .tokenfile import Pieces, Starts, TokenFile, map_file

__all__ = ["MANIFEST", "STORE_FORMAT", "id_dtype", "open_store", "shard_done", "shard_paths", "write_shard"]

MANIFEST = "tokens.json"
STORE_FORMAT = "tpplan-token-store"
VERSION = 1
PARTS = ("ids", "docs", "mask")


def id_dtype(vocab_size: int) -> str:
    """The narrowest dtype that holds every id of a vocabulary."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def shard_paths(folder: Path, index: int) -> dict[str, Path]:
    return {part: folder / "shards" / f"{index:05d}.{part}" for part in (*PARTS, "json")}


def write_shard(folder: Path, index: int, dtype: str,
                documents: Iterable[tuple[list[int], list[bool]]]) -> dict[str, Any]:
    """Write shard ``index`` from ``documents`` (ids with the separator, loss mask); returns
    its meta. The same documents give the same bytes, whatever wrote them and when."""
    paths = shard_paths(folder, index)
    paths["ids"].parent.mkdir(parents=True, exist_ok=True)
    tmp = {k: p.with_name(p.name + f".tmp-{os.getpid()}") for k, p in paths.items()}
    ids_, starts, masks = [], [], []
    at = loss = 0
    biggest = -1
    for ids, mask in documents:
        a = np.asarray(ids, dtype=np.int64)
        starts.append(at)
        at += len(a)
        biggest = max(biggest, int(a.max()) if len(a) else -1)
        ids_.append(a.astype(dtype))
        m = np.asarray(mask, dtype=np.uint8)
        masks.append(m)
        loss += int(m.sum())
    masked = loss < at
    arrays = {"ids": np.concatenate(ids_) if ids_ else np.zeros(0, dtype=dtype),
              "docs": np.asarray(starts, dtype=np.int64)}
    if masked:
        arrays["mask"] = np.concatenate(masks)
    try:
        for part, arr in arrays.items():
            arr.tofile(tmp[part])
        meta = {"index": index, "tokens": at, "documents": len(starts), "loss_tokens": loss,
                "masked": masked, "max_token": biggest,
                "sha256": {part: file_digest(tmp[part]) for part in arrays}}
        tmp["json"].write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
        for part in (*arrays, "json"):  # the .json last: it says the shard is whole
            os.replace(tmp[part], paths[part])
    finally:
        for p in tmp.values():
            p.unlink(missing_ok=True)
    return meta


def shard_done(folder: Path, index: int, dtype: str) -> dict[str, Any] | None:
    """The meta of shard ``index`` when it was written whole, else None (to be written)."""
    paths = shard_paths(folder, index)
    try:
        meta = json.loads(paths["json"].read_text())
        sizes = {"ids": meta["tokens"] * np.dtype(dtype).itemsize, "docs": 8 * meta["documents"],
                 "mask": meta["tokens"] if meta["masked"] else None}
        if all(paths[p].stat().st_size == n for p, n in sizes.items() if n is not None):
            return meta
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: not a token store manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != STORE_FORMAT:
        raise DataError(f"{path}: not a tpplan token store manifest (format '{STORE_FORMAT}')")
    return manifest


def _map(path: Path, dtype: str, n: int, what: str) -> np.ndarray:
    item = np.dtype(dtype).itemsize
    size = path.stat().st_size if path.exists() else -1
    if size != n * item:
        state = "missing" if size < 0 else f"{size} bytes"
        raise DataError(f"{path}: {state}, but the manifest says {n} {what} ({n * item} bytes): "
                        f"truncated or from another prepare; run tpplan data prepare again")
    return map_file(path, dtype)


def open_store(folder: Path) -> TokenFile:
    """The store at ``folder``, every shard mapped (sizes checked against the manifest)."""
    m = _read_manifest(folder)
    dtype = m["dtype"]
    ids, masks, starts = [], [], []
    base = 0
    for s in m["shards"]:
        paths = shard_paths(folder, s["index"])
        ids.append(_map(paths["ids"], dtype, s["tokens"], "tokens"))
        masks.append(_map(paths["mask"], "uint8", s["tokens"], "mask bytes") if s["masked"] else None)
        starts.append((base, _map(paths["docs"], "int64", s["documents"], "document starts"), 1))
        base += s["tokens"]
    sizes = [s["tokens"] for s in m["shards"]]
    sep = m.get("separator") or {}
    return TokenFile(folder, "store", Pieces(ids), dtype, documents=m["documents"],
                     starts=Starts(starts), mask=Pieces(masks, sizes) if m["masked"] else None,
                     max_token=m["max_token"], tokenizer=m.get("tokenizer"),
                     separator=sep.get("id"), loss_tokens=m["loss_tokens"])
