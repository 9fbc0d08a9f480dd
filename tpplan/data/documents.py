"""Documents of ``data.path`` for a tokenizer: text files, ``.jsonl`` and ``.parquet``
records with a text field, and chats (``messages`` lists).

A folder is read in sorted order (binary files and tests folders skipped, as for bytes).
Each text file is one document; each record of a ``.jsonl`` (one JSON object a line) or a
``.parquet`` is one. ``data.max_bytes`` caps the source bytes read, whole records at a
time. A mistake in a record is one line naming ``file:line`` (``file:row N`` in parquet).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import DataError
from .files import BINARY_PROBE, text_files
from .chat import check_messages

__all__ = ["Document", "PARQUET_HINT", "RECORD_SUFFIXES", "read_documents", "source_files", "to_document"]

RECORD_SUFFIXES = {"jsonl": (".jsonl",), "chat": (".jsonl",), "parquet": (".parquet",)}
PARQUET_HINT = "reading .parquet needs pyarrow: pip install 'tpplan[parquet]'"


@dataclass
class Document:
    value: str | list[dict]  # text, or a chat's messages
    where: str  # file:line, for errors about it

    @property
    def is_chat(self) -> bool:
        return isinstance(self.value, list)


def source_files(path: Path, fmt: str) -> list[Path]:
    """The files ``path`` stands for under ``fmt``, in the order they are read."""
    if not path.is_dir():
        return [path]
    suffixes = RECORD_SUFFIXES.get(fmt)
    return [f for f in text_files(path) if suffixes is None or f.name.endswith(suffixes)]


def read_documents(files: list[Path], fmt: str, text_field: str,
                   max_bytes: int) -> Iterator[Document]:
    """Every document of ``files``, in order, until ``max_bytes`` of source are read."""
    left = max_bytes
    for f in files:
        kind = fmt
        if fmt == "auto":
            kind = {".jsonl": "jsonl", ".parquet": "parquet"}.get(f.suffix, "text")
        if kind == "text":
            text = _read_text(f, left)
            if text is None:
                continue
            left -= len(text.encode())
            yield Document(text, str(f))
        else:
            reader = _parquet_records(f) if kind == "parquet" else _jsonl_records(f)
            for record, where, size in reader:
                yield to_document(record, where, fmt, text_field)
                left -= size
                if left <= 0:
                    break
        if left <= 0:
            return


def _read_text(f: Path, limit: int) -> str | None:
    with open(f, "rb") as fh:
        data = fh.read(limit)
    if b"\0" in data[:BINARY_PROBE]:  # a binary file in a text folder
        return None
    return data.decode("utf-8", errors="replace")


def _jsonl_records(f: Path) -> Iterator[tuple[Any, str, int]]:
    with open(f, "rb") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise DataError(f"{f}:{n}: not a JSON object ({e})") from None
            yield record, f"{f}:{n}", len(line)


def _parquet_records(f: Path) -> Iterator[tuple[Any, str, int]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{f}: {PARQUET_HINT}") from None
    try:
        table = pq.ParquetFile(f)
    except Exception as e:  # pyarrow's ArrowInvalid and friends
        raise DataError(f"{f}: not a parquet file ({str(e).splitlines()[0]})") from None
    row = 0
    for chunk in table.iter_batches():
        for record in chunk.to_pylist():
            row += 1
            yield record, f"{f}:row {row}", len(json.dumps(record, default=str))


def to_document(record: Any, where: str, fmt: str, text_field: str) -> Document:
    if not isinstance(record, dict):
        raise DataError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    chat = fmt == "chat" or (fmt in ("auto", "parquet") and "messages" in record
                             and text_field not in record)
    if chat:
        if "messages" not in record:
            raise DataError(f"{where}: no 'messages' list (a chat record)")
        return Document(check_messages(record["messages"], where), where)
    if text_field not in record:
        raise DataError(f"{where}: no '{text_field}' field (data.text_field; fields here: "
                        f"{', '.join(map(str, record)) or 'none'})")
    if not isinstance(record[text_field], str):
        raise DataError(f"{where}: '{text_field}' must be a string, got "
                        f"{type(record[text_field]).__name__}")
    return Document(record[text_field], where)
