"""``tpplan data prepare``: text, jsonl, parquet, chats and HuggingFace ``datasets`` folders
tokenized by N worker processes into a token store (:mod:`.store`).

The input is cut into units (:mod:`.units`) that depend on the input alone; each worker
tokenizes whole units, each into its own shard, written atomically. The manifest is written
last, from the shards' own records, in unit order. So the store's bytes are the same for 1 or
N workers, and a prepare killed half-way and started again keeps the shards it finished and
makes the same store as one that never stopped. A folder holding another prepare's shards
(other inputs, tokenizer or settings) is refused unless ``overwrite``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from multiprocessing import get_all_start_methods, get_context
from pathlib import Path
from typing import Any

from .chat import render_chat
from .documents import Document
from .errors import DataError
from .store import MANIFEST, STORE_FORMAT, VERSION, id_dtype, shard_done, write_shard
from .tokenizer import TextTokenizer
from .units import Unit, plan_units, unit_documents

__all__ = ["PrepareJob", "Prepared", "pack", "prepare", "refuse_output_inside", "store_manifest", "write_manifest"]

JOB_FILE = "prepare.json"
ENCODE_CHUNK = 256  # texts encoded together (the tokenizers library batches in Rust)
PARALLELISM = "TOKENIZERS_PARALLELISM"


@dataclass
class PrepareJob:
    """What to tokenize and how: the key a restart must match."""

    input: str
    output: str
    tokenizer: str
    format: str = "auto"  # auto | text | jsonl | parquet | chat | hf
    text_field: str = "text"
    separator: str | None = None
    docs_per_shard: int = 10_000


@dataclass
class Prepared:
    manifest: dict[str, Any]
    made: int  # shards written by this call
    kept: int  # shards a killed earlier call had finished
    seconds: float


_WORKER: dict[str, Any] = {}


def _start_worker(job: dict[str, Any]) -> None:
    os.environ.setdefault(PARALLELISM, "false")
    tok = TextTokenizer(Path(job["tokenizer"]))
    _WORKER.update(job=job, tok=tok, sep=tok.separator(job["separator"])[1],
                   dtype=id_dtype(tok.vocab_size))


def pack(documents: Iterable[Document], tok: TextTokenizer, sep: int) -> Iterator[tuple[list[int], list[bool]]]:
    """(ids with the separator, loss mask) of each document, in order: texts encoded
    ``ENCODE_CHUNK`` at a time, chats rendered with the template (the assistant's tokens
    count). The one packing both ``data prepare`` and the per-run token cache use."""
    texts: list[str] = []

    def flush():
        for ids in tok.encode(texts):
            yield ids + [sep], [True] * (len(ids) + 1)
        texts.clear()

    for doc in documents:
        if doc.is_chat:
            yield from flush()  # keep the documents' order
            ids, mask = render_chat(tok.hf, doc.value, doc.where)
            yield ids + [sep], mask + [False]  # the template ends the turn; the separator is no target
        else:
            texts.append(doc.value)
            if len(texts) >= ENCODE_CHUNK:
                yield from flush()
    yield from flush()


def _documents(unit: Unit):
    job = _WORKER["job"]
    return pack(unit_documents(unit, job["format"], job["text_field"]), _WORKER["tok"], _WORKER["sep"])


@contextlib.contextmanager
def _pool(workers: int, spec: dict[str, Any]) -> Iterator[ProcessPoolExecutor | None]:
    """``workers`` tokenizing processes, or None for one (this process). Forked where the
    platform allows (no second import of torch per worker), before any other thread runs.
    One worker is this process, its tokenizer single-threaded as a worker's is (so 1 and N
    workers compare like for like), and the setting given back after: a training rank that
    builds its token cache here keeps its own environment."""
    if workers <= 1:
        before = os.environ.get(PARALLELISM)
        _start_worker(spec)
        try:
            yield None
        finally:
            if before is None:
                os.environ.pop(PARALLELISM, None)
            else:
                os.environ[PARALLELISM] = before
        return
    method = "fork" if "fork" in get_all_start_methods() and sys.platform == "linux" else "spawn"
    with ProcessPoolExecutor(workers, mp_context=get_context(method), initializer=_start_worker,
                             initargs=(spec,)) as pool:
        yield pool


def _make_shard(index: int, unit: Unit) -> dict[str, Any]:
    return write_shard(Path(_WORKER["job"]["output"]), index, _WORKER["dtype"], _documents(unit))


def _inputs_key(job: PrepareJob, tok: TextTokenizer) -> dict[str, Any]:
    src = Path(job.input)
    files = [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file())
    return {"job": {k: v for k, v in asdict(job).items() if k != "output"},
            "tokenizer": tok.identity(),
            "inputs": [[str(f.relative_to(src) if f != src else f.name), f.stat().st_size, f.stat().st_mtime_ns]
                       for f in files]}


def _claim(out: Path, key: dict[str, Any], overwrite: bool) -> None:
    """Start or continue the prepare in ``out``: the same key continues, another is refused."""
    job_file = out / JOB_FILE
    if job_file.is_file():
        try:
            found = json.loads(job_file.read_text())
        except ValueError:
            found = None
        if found == key:
            return
        if not overwrite:
            raise DataError(f"{out}: holds a prepare of other inputs, tokenizer or settings; pass "
                            f"--overwrite to replace it, or choose another --output")
    elif out.exists() and any(out.iterdir()) and not overwrite:
        raise DataError(f"{out}: not empty and not a token store; pass --overwrite or choose "
                        f"another --output")
    for old in ("shards", MANIFEST, JOB_FILE):
        p = out / old
        shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    job_file.write_text(json.dumps(key, indent=1, sort_keys=True) + "\n")


def refuse_output_inside(src: Path, out: Path) -> None:
    """Refuse an output folder inside the input folder (or the same one), before any work:
    the input is every file under it, so a restarted or later prepare would read the store's
    own shards as input (and its key, the inputs' sizes, would change under it)."""
    a, b = src.resolve(), out.resolve()
    if a.is_dir() and (b == a or a in b.parents):
        raise DataError(f"{out}: the output folder is inside the input folder {src}; its shards would be read "
                        f"as input by a later or restarted prepare: choose an output outside {src}")


def store_manifest(job: PrepareJob, tok: TextTokenizer, metas: list[dict[str, Any]],
                   inputs: list) -> dict[str, Any]:
    """The store's ``tokens.json`` for shards ``metas`` (in order) of ``job``."""
    sep_name, sep = tok.separator(job.separator)
    return {"format": STORE_FORMAT, "version": VERSION, "dtype": id_dtype(tok.vocab_size),
            "tokenizer": {"identity": tok.identity(), "name": Path(job.tokenizer).name,
                          "vocab_size": tok.vocab_size},
            "separator": {"token": sep_name, "id": sep},
            "tokens": sum(m["tokens"] for m in metas), "documents": sum(m["documents"] for m in metas),
            "loss_tokens": sum(m["loss_tokens"] for m in metas),
            "masked": any(m["masked"] for m in metas),
            "max_token": max((m["max_token"] for m in metas), default=-1),
            "shards": metas, "inputs": inputs}


def write_manifest(out: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """``manifest`` into ``out/tokens.json`` atomically: the store is whole once it exists."""
    tmp = out / f"{MANIFEST}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, out / MANIFEST)
    return manifest


def prepare(job: PrepareJob, workers: int = 1, overwrite: bool = False,
            progress: Callable[[int, int, int, int], None] | None = None) -> Prepared:
    """Tokenize ``job.input`` into the store ``job.output`` with ``workers`` processes;
    ``progress(shards done, shards, documents, tokens)`` after each shard."""
    t0 = time.perf_counter()
    refuse_output_inside(Path(job.input), Path(job.output))
    tok = TextTokenizer(Path(job.tokenizer))
    tok.separator(job.separator)  # a missing separator said before any work
    out = Path(job.output)
    key = _inputs_key(job, tok)
    _claim(out, key, overwrite)
    units = plan_units(Path(job.input), job.format, job.docs_per_shard)
    dtype = id_dtype(tok.vocab_size)
    metas: dict[int, dict[str, Any]] = {}
    for i in range(len(units)):
        if (meta := shard_done(out, i, dtype)) is not None:
            metas[i] = meta
    kept = len(metas)
    todo = [i for i in range(len(units)) if i not in metas]
    docs, tokens = (sum(m[k] for m in metas.values()) for k in ("documents", "tokens"))
    spec = asdict(job)
    with _pool(min(workers, len(todo)), spec) as pool:  # no process forked for no unit
        if pool is None:
            made = ((_make_shard(i, units[i]), i) for i in todo)
        else:  # every unit queued (the workers forked) before the progress bar's thread starts
            futures = {pool.submit(_make_shard, i, units[i]): i for i in todo}
            made = ((f.result(), futures[f]) for f in as_completed(futures))
        if progress:
            progress(len(metas), len(units), docs, tokens)
        for meta, i in made:
            metas[i] = meta
            docs, tokens = docs + meta["documents"], tokens + meta["tokens"]
            if progress:
                progress(len(metas), len(units), docs, tokens)
    manifest = write_manifest(out, store_manifest(job, tok, [metas[i] for i in range(len(units))],
                                                  key["inputs"]))
    return Prepared(manifest, len(todo), kept, time.perf_counter() - t0)
