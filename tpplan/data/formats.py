"""What a token source on disk is, told from the path and never guessed.

- a folder holding ``tokens.json``: tpplan's token store (:mod:`.store`, made by
  ``tpplan data prepare``);
- ``prefix`` (or ``prefix.bin`` / ``prefix.idx``) beside a ``prefix.idx``: a Megatron-Core
  indexed dataset (:mod:`.megatron`);
- any other file with its ``dtype`` stated (``uint16``, ``uint32``, ``int32``): a flat file
  of ids, nanoGPT's ``train.bin``. Its size must be a whole number of ids.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .errors import DataError
from .megatron import open_megatron
from .store import MANIFEST, open_store
from .tokenfile import Pieces, TokenFile, map_file

__all__ = ["FLAT_DTYPES", "is_token_source", "open_tokens"]

FLAT_DTYPES = ("uint16", "uint32", "int32")


def _megatron_prefix(p: Path) -> Path | None:
    prefix = p.with_suffix("") if p.suffix in (".bin", ".idx") else p
    return prefix if prefix.with_name(prefix.name + ".idx").is_file() else None


def is_token_source(path: str, dtype: str | None) -> bool:
    """Whether ``path`` is read as token ids (not text for a tokenizer or bytes)."""
    p = Path(path)
    return dtype is not None or (p / MANIFEST).is_file() or _megatron_prefix(p) is not None


def open_flat(p: Path, dtype: str) -> TokenFile:
    item = np.dtype(dtype).itemsize
    size = p.stat().st_size
    if size % item:
        raise DataError(f"{p}: {size} bytes is not a whole number of {dtype} ids ({item} bytes "
                        f"each): is data.dtype right, or the file cut short?")
    arr = map_file(p, dtype)
    return TokenFile(p, "flat", Pieces([arr]), dtype)


def open_tokens(path: str, dtype: str | None) -> TokenFile:
    """The token source at ``path``; a mistake in it is a one-line :class:`DataError`."""
    p = Path(path)
    try:
        if (p / MANIFEST).is_file():
            return open_store(p)
        prefix = _megatron_prefix(p)
        if prefix is not None:
            return open_megatron(prefix)
        if dtype is None:
            raise DataError(f"{p}: a file of token ids needs its dtype stated (data.dtype: "
                            f"{', '.join(FLAT_DTYPES)}); tpplan does not guess it")
        if dtype not in FLAT_DTYPES:
            raise DataError(f"{p}: data.dtype '{dtype}' is not one of {', '.join(FLAT_DTYPES)}")
        if p.is_dir():
            raise DataError(f"{p}: a folder without {MANIFEST} (not a token store made by "
                            f"tpplan data prepare)")
        return open_flat(p, dtype)
    except OSError as e:
        raise DataError(f"{e.filename or p}: {e.strerror or e}") from None
