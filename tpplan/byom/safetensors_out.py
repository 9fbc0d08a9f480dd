"""Sharded safetensors written one tensor at a time, as HuggingFace lays them out.

The safetensors format is an 8-byte little-endian header length, a JSON header (each
tensor's dtype, shape and byte range) and the tensors' bytes back to back. Every shape and
dtype is known before any tensor is read, so a shard's header is written first and each
tensor is fetched, written and dropped in turn: memory holds one tensor, never a shard.
(``safetensors.torch.save_file`` takes the whole shard as a dict and copies it to bytes.)

Shards follow ``save_pretrained``: ``model.safetensors`` when one is enough, else
``model-00001-of-0000N.safetensors`` and ``model.safetensors.index.json`` mapping every
tensor to its file. Tensors go into shards in order; a shard closes before the tensor that
would take it past the limit, and a tensor larger than the limit gets a shard of its own.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

__all__ = ["Entry", "parse_size", "shard_groups", "write_sharded"]

INDEX_FILE = "model.safetensors.index.json"
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@dataclass(frozen=True)
class Entry:
    """One tensor to write: its name in the file, and what it will be once fetched."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def parse_size(text: str | int) -> int:
    """``5GB`` (10⁹), ``500MiB`` (2²⁰), ``1.5GB``, or bytes -> bytes, as transformers reads
    ``max_shard_size``. ``ValueError`` says what is accepted."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(text), re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"'{text}' is not a size (say 5GB, 500MB, 2GiB or a number of bytes)")
    return int(float(m.group(1)) * UNITS[(m.group(2) or "").upper()])


def shard_groups(entries: list[Entry], max_bytes: int) -> list[list[Entry]]:
    """``entries`` in order, cut into shards of at most ``max_bytes`` of tensor data."""
    groups: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if groups[-1] and size + e.nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(e)
        size += e.nbytes
    return [g for g in groups if g]


def _header(entries: list[Entry]) -> bytes:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in entries:
        header[e.name] = {"dtype": SAFETENSORS_DTYPES[e.dtype], "shape": list(e.shape),
                          "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # the data starts 8-byte aligned


def _write_shard(path: Path, entries: list[Entry], fetch: Callable[[Entry], torch.Tensor]) -> None:
    header = _header(entries)
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        for e in entries:
            t = fetch(e)
            if tuple(t.shape) != e.shape or t.dtype != e.dtype:
                raise ValueError(f"{e.name}: fetched {tuple(t.shape)} {t.dtype}, expected "
                                 f"{e.shape} {e.dtype}")
            # The tensor's own bytes through the buffer protocol: no copy of it in Python.
            f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)


def write_sharded(folder: Path, entries: list[Entry], fetch: Callable[[Entry], torch.Tensor],
                  max_bytes: int) -> list[str]:
    """Write ``entries`` (each fetched when its turn comes) into ``folder`` as HF-style
    shards; return the files written (the index last, when there is one)."""
    groups = shard_groups(entries, max_bytes)
    if len(groups) == 1:
        _write_shard(folder / "model.safetensors", groups[0], fetch)
        return ["model.safetensors"]
    files, weight_map = [], {}
    for i, group in enumerate(groups, 1):
        name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        _write_shard(folder / name, group, fetch)
        files.append(name)
        weight_map.update({e.name: name for e in group})
    index = {"metadata": {"total_size": sum(e.nbytes for e in entries)}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return [*files, INDEX_FILE]
