"""The work of ``tpplan data prepare`` cut into units, one shard each, by the input alone.

A unit is up to ``docs_per_shard`` documents of one input: text files (one document
each, grouped), a stretch of ``.jsonl`` lines (found by one pass over the file counting
lines), a range of ``.parquet`` rows or of a HuggingFace ``datasets`` folder's rows
(``save_to_disk``; memory-mapped Arrow, read a slice at a time). The units depend on the
inputs and ``docs_per_shard`` only, never on the number of workers: any number of workers,
or a run killed and restarted, makes the same shards.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .documents import PARQUET_HINT, RECORD_SUFFIXES, Document, to_document
from .errors import DataError
from .files import BINARY_PROBE, text_files

__all__ = ["Unit", "is_hf_folder", "plan_units", "unit_documents"]

COUNT_BLOCK = 1 << 22


@dataclass(frozen=True)
class Unit:
    kind: str  # text | jsonl | parquet | hf
    paths: tuple[str, ...]  # text: the files; else the one input
    lo: int = 0  # first record (jsonl: first byte) of the unit
    hi: int = 0  # past the last record (jsonl: past the last byte)
    first_line: int = 1  # jsonl: the line number of ``lo``, for errors


def is_hf_folder(path: Path) -> bool:
    """A folder written by ``datasets``' ``save_to_disk`` (a ``Dataset``, not a dict of them)."""
    return path.is_dir() and (path / "state.json").is_file() and (path / "dataset_info.json").is_file()


def _kind(f: Path, fmt: str) -> str:
    if fmt in ("jsonl", "chat"):
        return "jsonl"
    if fmt == "auto":
        return {".jsonl": "jsonl", ".parquet": "parquet"}.get(f.suffix, "text")
    return fmt


def _jsonl_units(f: Path, per: int) -> list[Unit]:
    """Stretches of ``per`` lines (blank ones included: the count is the file's own)."""
    units, start, line, lines, at = [], 0, 1, 0, 0
    with open(f, "rb") as fh:
        while block := fh.read(COUNT_BLOCK):
            pos = 0
            while (nl := block.find(b"\n", pos)) >= 0:
                pos = nl + 1
                lines += 1
                if lines == per:
                    units.append(Unit("jsonl", (str(f),), start, at + pos, line))
                    start, line, lines = at + pos, line + per, 0
            at += len(block)
    if at > start:
        units.append(Unit("jsonl", (str(f),), start, at, line))
    return units


def _rows(kind: str, f: Path) -> int:
    if kind == "hf":
        return len(_hf_dataset(f))
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{f}: {PARQUET_HINT}") from None
    try:
        return pq.ParquetFile(f).metadata.num_rows
    except Exception as e:  # pyarrow's ArrowInvalid and friends
        raise DataError(f"{f}: not a parquet file ({str(e).splitlines()[0]})") from None


def plan_units(path: Path, fmt: str, per: int) -> list[Unit]:
    """Every unit of the input at ``path`` under ``fmt``, in order."""
    if not path.exists():
        raise DataError(f"{path}: no such file or folder")
    if fmt == "hf" or (fmt == "auto" and is_hf_folder(path)):
        n = _rows("hf", path)
        return [Unit("hf", (str(path),), lo, min(lo + per, n)) for lo in range(0, n, per)]
    suffixes = RECORD_SUFFIXES.get(fmt)
    files = [path] if not path.is_dir() else [
        f for f in text_files(path) if suffixes is None or f.name.endswith(suffixes)]
    units, texts = [], []
    for f in files:
        kind = _kind(f, fmt)
        if kind == "text":
            texts.append(str(f))
            if len(texts) == per:
                units.append(Unit("text", tuple(texts)))
                texts = []
            continue
        if texts:
            units.append(Unit("text", tuple(texts)))
            texts = []
        if kind == "jsonl":
            units += _jsonl_units(f, per)
        else:
            n = _rows(kind, f)
            units += [Unit(kind, (str(f),), lo, min(lo + per, n)) for lo in range(0, n, per)]
    if texts:
        units.append(Unit("text", tuple(texts)))
    if not units:
        raise DataError(f"{path}: no documents to prepare (an empty file or a folder without "
                        f"{fmt} files)")
    return units


def _hf_dataset(path: Path):
    try:
        import datasets
    except ImportError:
        raise DataError(f"{path}: reading a datasets folder needs datasets: pip install "
                        f"'tpplan[datasets]'") from None
    try:
        return datasets.load_from_disk(str(path))
    except Exception as e:  # datasets raises FileNotFoundError, ValueError and its own
        raise DataError(f"{path}: datasets cannot load this folder: {str(e).splitlines()[0]}") from None


def _records(unit: Unit) -> Iterator[tuple[object, str]]:
    f = unit.paths[0]
    if unit.kind == "jsonl":
        with open(f, "rb") as fh:
            fh.seek(unit.lo)
            # lines as the unit counted them (b"\n"), not splitlines(): a stray \r is no new record
            for n, line in enumerate(fh.read(unit.hi - unit.lo).split(b"\n"), unit.first_line):
                if line.strip():
                    try:
                        yield json.loads(line), f"{f}:{n}"
                    except ValueError as e:
                        raise DataError(f"{f}:{n}: not a JSON object ({e})") from None
    elif unit.kind == "hf":
        part = _hf_dataset(Path(f)).select(range(unit.lo, unit.hi))
        for i, record in enumerate(part, unit.lo):
            yield record, f"{f}:row {i + 1}"
    else:
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(f)
        groups, starts, at = [], [], 0  # only the row groups that hold the unit's rows: no re-reading
        for g in range(pf.metadata.num_row_groups):
            n = pf.metadata.row_group(g).num_rows
            if at + n > unit.lo and at < unit.hi:
                groups.append(g)
                starts.append(at)
            at += n
        row = starts[0] if starts else 0
        for chunk in pf.iter_batches(row_groups=groups):
            if row + chunk.num_rows <= unit.lo:
                row += chunk.num_rows
                continue
            for record in chunk.to_pylist():
                row += 1
                if unit.lo < row <= unit.hi:
                    yield record, f"{f}:row {row}"
            if row >= unit.hi:
                return


def unit_documents(unit: Unit, fmt: str, text_field: str) -> Iterator[Document]:
    """The documents of ``unit``, in order; a mistake in one is a line naming its place."""
    if unit.kind == "text":
        for f in unit.paths:
            data = Path(f).read_bytes()
            if b"\0" not in data[:BINARY_PROBE]:  # a binary file in a text folder: skipped
                yield Document(data.decode("utf-8", errors="replace"), f)
        return
    record_fmt = "chat" if fmt == "chat" else ("parquet" if unit.kind in ("parquet", "hf") else fmt)
    for record, where in _records(unit):
        yield to_document(record, where, record_fmt if record_fmt != "hf" else "parquet", text_field)
