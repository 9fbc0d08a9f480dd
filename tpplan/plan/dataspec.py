"""The ``data:`` section as typed data: where the tokens come from (see docs/data.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .errors import Loc

__all__ = ["DATA_FORMATS", "TOKEN_DTYPES", "DataSpec", "SourceSpec", "plan_relative"]

# How ``data.path`` is read with a tokenizer; ``auto`` goes by each file's suffix (and a
# ``.jsonl`` whose first record holds ``messages`` is chat).
DATA_FORMATS = ("auto", "text", "jsonl", "parquet", "chat")
# The ids of a flat token file (``data.dtype``): stated, never guessed from the file.
TOKEN_DTYPES = ("uint16", "uint32", "int32")


def plan_relative(path: str, base_dir: str | None) -> str:
    """A path written in a plan: a relative one is looked for next to the plan first, then
    as given (from the working folder), as ``model.hf_config`` is."""
    p = Path(path)
    if not p.is_absolute() and base_dir is not None and (Path(base_dir) / p).exists():
        return str(Path(base_dir) / p)
    return path


@dataclass
class SourceSpec:
    """One entry of ``data.sources``: a token source (a store, a Megatron prefix, a flat
    file with ``dtype``) and its ``weight`` in the mixture."""

    path: str
    weight: float = 1.0
    dtype: str | None = None  # a flat file's ids; default data.dtype
    loc: Loc | None = None
    locs: dict[str, Loc] = field(default_factory=dict)


@dataclass
class DataSpec:
    """``data:`` — null ``path`` reads the Python standard library's own sources; without a
    ``tokenizer`` every file is bytes (vocabulary 256); a token store, a Megatron prefix or a
    file of ids with ``dtype`` is memory-mapped; ``sources`` mixes several by weight."""

    path: str | None = None
    max_bytes: int = 4_000_000  # cap on the text bytes read (the stdlib default stays fast); stated when it cuts
    dtype: str | None = None  # the ids of a flat token file: uint16, uint32 or int32 (never guessed)
    sources: list[SourceSpec] = field(default_factory=list)  # a mixture of token sources
    tokenizer: str | None = None  # a tokenizer.json or a HF model/tokenizer folder
    format: str = "auto"  # one of DATA_FORMATS
    text_field: str = "text"  # the field of a .jsonl / .parquet record that holds the text
    separator: str | None = None  # token between packed documents; null: the tokenizer's eos
    workers: int | None = None  # processes tokenizing the per-run cache; null: min(8, CPUs this process may use)
    document_mask: bool = True  # packed documents attend within themselves only (positions restart)
    base_dir: str | None = None  # the plan's folder: relative paths are looked for there first
    loc: Loc | None = None
    locs: dict[str, Loc] = field(default_factory=dict)

    def resolved(self, path: str | None) -> str | None:
        return None if path is None else plan_relative(path, self.base_dir)
