"""Megatron-Core indexed datasets (``prefix.bin`` + ``prefix.idx``), read natively.

The ``.idx`` layout (megatron/core/datasets/indexed_dataset.py, ``_IndexWriter``):
``MMIDIDX\\0\\0``, version (u64 = 1), dtype code (u8), sequence count S (u64), document
count D (u64), then S int32 sequence lengths, S int64 sequence pointers (byte offsets into
the ``.bin``), D int64 document indices (sequence numbers where documents start; the first
is 0, the last is S), and with multimodal data S int8 modes. Everything past the header is
memory-mapped; a file cut short or a ``.bin`` that does not end where the index says is an
error naming it.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from .errors import DataError
from .tokenfile import Pieces, Starts, TokenFile, map_file, unmap

__all__ = ["HEADER", "MEGATRON_DTYPES", "open_megatron", "read_index"]

HEADER = b"MMIDIDX\x00\x00"
MEGATRON_DTYPES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64",
                   7: "float32", 8: "uint16"}
HEAD_BYTES = 9 + 8 + 1 + 8 + 8
BLOCK = 1 << 16  # documents whose first pointers are gathered at a time


def read_index(idx: Path) -> tuple[str, np.ndarray, np.ndarray, np.ndarray]:
    """(token dtype, sequence lengths, sequence pointers, document indices), mapped."""
    size = idx.stat().st_size
    with open(idx, "rb") as f:
        head = f.read(HEAD_BYTES)
    if len(head) < HEAD_BYTES or head[:9] != HEADER:
        raise DataError(f"{idx}: not a Megatron index (.idx starts with {HEADER!r}; "
                        f"{size} bytes here)")
    version, code, seqs, docs = struct.unpack("<QBQQ", head[9:])
    if version != 1 or code not in MEGATRON_DTYPES:
        raise DataError(f"{idx}: Megatron index version {version} / dtype code {code} is not "
                        f"one tpplan reads (version 1, codes {sorted(MEGATRON_DTYPES)})")
    need = HEAD_BYTES + 12 * seqs + 8 * docs
    if size < need:
        raise DataError(f"{idx}: truncated: {size} bytes, but its header's {seqs} sequences and "
                        f"{docs - 1} documents need {need}")
    mm = map_file(idx, "uint8")
    lengths = mm[HEAD_BYTES:HEAD_BYTES + 4 * seqs].view(np.int32)
    pointers = mm[HEAD_BYTES + 4 * seqs:HEAD_BYTES + 12 * seqs].view(np.int64)
    documents = mm[HEAD_BYTES + 12 * seqs:need].view(np.int64)
    return MEGATRON_DTYPES[code], lengths, pointers, documents


def _first_pointers(idx: Path, pointers: np.ndarray, documents: np.ndarray) -> np.ndarray:
    """Each document's first sequence's byte pointer: the one array a dataset of documents of
    several sequences costs a rank (8 bytes a document). Gathered ``BLOCK`` documents at a
    time, the index's pages each block read unmapped again after it, so opening never holds
    the ``.idx`` (12 bytes a sequence) in the rank's resident set."""
    n = max(len(documents) - 1, 0)
    out = np.empty(n, dtype=np.int64)
    for lo in range(0, n, BLOCK):
        hi = min(lo + BLOCK, n)
        seq = np.asarray(documents[lo:hi])
        first, last = int(seq.min()), int(seq.max())
        if first < 0 or last >= len(pointers):
            raise DataError(f"{idx}: a document starts at sequence {first if first < 0 else last}, outside its "
                            f"{len(pointers)} sequences (a damaged index)")
        out[lo:hi] = pointers[seq]
        unmap(documents, lo, hi - lo)
        unmap(pointers, first, last - first + 1)
    return out


def open_megatron(prefix: Path) -> TokenFile:
    """``prefix.bin`` through its ``prefix.idx``: documents as Megatron's reader returns them."""
    idx, bin_ = prefix.with_name(prefix.name + ".idx"), prefix.with_name(prefix.name + ".bin")
    dtype, lengths, pointers, documents = read_index(idx)
    if dtype.startswith("float"):
        raise DataError(f"{idx}: a Megatron dataset of {dtype} values, not token ids")
    item = np.dtype(dtype).itemsize
    size = bin_.stat().st_size
    end = int(pointers[-1]) + item * int(lengths[-1]) if len(lengths) else 0
    if size != end:
        raise DataError(f"{bin_}: {size} bytes, but {idx.name} says its {len(lengths)} "
                        f"sequences end at byte {end}{' (truncated)' if size < end else ''}")
    tokens = map_file(bin_, dtype)
    if len(documents) == len(lengths) + 1:  # one sequence a document: the pointers are the starts
        starts = pointers
    else:  # documents of several sequences: their first sequences' pointers (one int64 each)
        starts = _first_pointers(idx, pointers, documents)
    return TokenFile(bin_, "megatron", Pieces([tokens]), dtype, documents=max(len(documents) - 1, 0),
                     starts=Starts([(0, starts, item)]))
