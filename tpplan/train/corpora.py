"""The training and held-out corpora a plan asks for (``data`` and ``eval`` sections).

Without ``data.tokenizer``: bytes or ``.bin``, as always. With one: the sources are
tokenized (chats with their template) and packed -- each document followed by the separator
token -- into the run folder's token cache (:mod:`.cache`), once: the whole input by
``data.workers`` processes into the store ``tpplan data prepare`` would make of it
(:func:`tpplan.data.prepare.prepare`), or, when the input is larger than ``data.max_bytes``,
its first ``max_bytes`` in this process into one shard (the header says so). A chat's
separator is not a loss target (the template's own end of turn is); a text's is (the model
learns where documents end).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..data.feed import HeldOut, Source, TokenFeed
from ..data.formats import is_token_source, open_tokens
from ..data.scan import check_source
from ..plan import ErrorList, PlanErrors
from ..plan.specs import DataSpec, EvalSpec, SourceSpec
from ..data.prepare import PrepareJob, pack, prepare, refuse_output_inside, store_manifest, write_manifest
from ..data.store import id_dtype, write_shard
from .cache import CACHE_DIR, cached, file_digest
from .data import Corpus, DataError, load_corpus
from .sources import read_documents, source_files
from .tokens import TextTokenizer

__all__ = ["Corpora", "data_plan", "default_workers", "load_corpora", "open_feed", "token_sources"]

@dataclass
class Corpora:
    train: Corpus
    eval: Corpus | None = None
    notes: list[str] = field(default_factory=list)  # for the header, rank 0


def _tokenizer(data: DataSpec, model_vocab: int | None) -> TextTokenizer:
    errs = ErrorList()
    where = data.locs.get("tokenizer", data.loc)
    path = Path(data.resolved(data.tokenizer))
    if not path.exists():
        errs.add(f"data.tokenizer '{data.tokenizer}' does not exist (a tokenizer.json, or a "
                 f"HuggingFace model or tokenizer folder)", where)
        errs.raise_if_any()
    try:
        tok = TextTokenizer(path)
        vocab = tok.vocab_size
    except DataError as e:
        errs.add(str(e), where)
        errs.raise_if_any()
    if model_vocab is not None and vocab > model_vocab:
        errs.add(f"data.tokenizer {path} has a vocabulary of {vocab} tokens, more than the "
                 f"model's {model_vocab}: its ids past {model_vocab - 1} have no embedding",
                 where)
    errs.raise_if_any()
    return tok


def default_workers() -> int:
    """``data.workers`` left out: one process per CPU this process may run on, at most 8 (a
    default that forks no dozens of processes on a large node; ``data.workers`` sets more)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return min(8, cpus)


def _tokenized(role: str, path: Path, data: DataSpec, tok: TextTokenizer,
               cache_dir: Path) -> tuple[Corpus, list[str]]:
    files = source_files(path, data.format)
    if not files:
        raise DataError(f"{path}: no {data.format} files in this folder")
    refuse_output_inside(path, cache_dir / role)  # data.path holding the run folder would read its own cache
    sep_name, sep = tok.separator(data.separator)
    key = {"sources": [{"path": str(f.resolve()), "bytes": f.stat().st_size,
                        "sha256": file_digest(f)} for f in files],
           "tokenizer": tok.identity(), "format": data.format, "text_field": data.text_field,
           "separator": sep_name, "max_bytes": data.max_bytes}
    size = sum(k["bytes"] for k in key["sources"])
    cut = size > data.max_bytes
    job = PrepareJob(str(path), "", str(tok.path), data.format, data.text_field, data.separator)
    workers = data.workers or default_workers()

    def build(store: Path) -> dict:
        if not cut:  # the whole input: the store `tpplan data prepare` makes of it, by as many workers
            return prepare(replace(job, output=str(store)), workers, overwrite=True).manifest
        # the first data.max_bytes of it (the header says so), in this process, into one shard
        shutil.rmtree(store)
        docs = read_documents(files, data.format, data.text_field, data.max_bytes)
        meta = write_shard(store, 0, id_dtype(tok.vocab_size), pack(docs, tok, sep))
        inputs = [[k["path"], k["bytes"], k["sha256"]] for k in key["sources"]]
        return write_manifest(store, store_manifest(job, tok, [meta], inputs))

    t0 = time.perf_counter()
    tokens, mask, manifest, reused = cached(cache_dir, role, key, build)
    source = f"{path} ({manifest['documents']} documents, tokenizer {tok.path})"
    counted = (f", {manifest['loss_tokens']:,} of them assistant tokens (the loss)"
               if manifest["masked"] else "")
    shards = manifest.get("shards", 1)
    how = "" if reused else (f" ({shards} shard(s) by {min(workers, shards) if not cut else 1} "
                             f"process(es) in {time.perf_counter() - t0:.1f} s)")
    notes = [f"{role} tokens: {manifest['tokens']:,}{counted}; "
             f"{'reused' if reused else 'made'} the token store {cache_dir / role}{how}"]
    if cut:
        notes.append(f"data.max_bytes={data.max_bytes:,} cut {role} data {path} ({size:,} bytes) at its first "
                     f"{data.max_bytes:,} bytes; the rest is not tokenized (raise data.max_bytes to tokenize "
                     f"all of it with data.workers processes, or prepare it with tpplan data prepare)")
    return Corpus(tokens, manifest["max_token"] + 1, source, mask, packed=True,
                  separator=sep), notes


def _read(role: str, path: str, data: DataSpec, tok: TextTokenizer | None,
          cache_dir: Path) -> tuple[Corpus, list[str]]:
    if tok is None:
        corpus = load_corpus(path, data.max_bytes)
        capped = [f"data.max_bytes={data.max_bytes:,} cut {role} data {corpus.source} at its first "
                  f"{data.max_bytes:,} bytes; the rest is not read (raise data.max_bytes, or prepare "
                  f"it with tpplan data prepare)"] if len(corpus) >= data.max_bytes else []
        return corpus, capped
    return _tokenized(role, Path(path), data, tok, cache_dir)


def load_corpora(data: DataSpec, ev: EvalSpec, run_dir: Path, model_vocab: int | None,
                 seq_len: int) -> Corpora:
    """Read (or map from the cache) what the plan trains and evaluates on. Raises
    PlanErrors for a mistake in the plan, DataError (one line) for one in the data."""
    errs = ErrorList()
    path = data.resolved(data.path)
    if data.tokenizer is None and path is not None and path.endswith(".bin"):
        errs.add(f"data.path '{data.path}' is a file of token ids: state their dtype with data.dtype "
                 f"(uint16, uint32 or int32); tpplan does not guess it", data.locs.get("path", data.loc))
    if data.tokenizer is not None and path is not None and path.endswith(".bin"):
        errs.add(f"data.path '{data.path}' is pre-tokenized (.bin): leave data.tokenizer out",
                 data.locs.get("tokenizer", data.loc))
    if data.tokenizer is not None and path is None:
        errs.add("data.tokenizer needs data.path (the text or chats to tokenize)",
                 data.locs.get("tokenizer", data.loc))
    eval_path = ev.path and data.resolved(ev.path)
    if eval_path is not None and not Path(eval_path).exists():
        errs.add(f"eval.path '{ev.path}' does not exist", ev.locs.get("path", ev.loc))
    errs.raise_if_any()
    tok = _tokenizer(data, model_vocab) if data.tokenizer is not None else None
    cache_dir = run_dir / CACHE_DIR
    train, notes = _read("train", path, data, tok, cache_dir)
    out = Corpora(train, notes=notes)
    if eval_path is not None:
        out.eval, more = _read("eval", eval_path, data, tok, cache_dir)
        out.eval.packed = True
        out.notes += more
    elif ev.fraction is not None:
        out.train, out.eval = train.split(ev.fraction, seq_len)
    return out


def token_sources(data: DataSpec) -> list[SourceSpec]:
    """The token sources a plan trains on (``data.sources``, or a ``data.path`` that is a
    store, a Megatron prefix or a file with ``data.dtype``); empty: text or bytes."""
    if data.sources:
        return data.sources
    path = data.resolved(data.path)
    if path is not None and is_token_source(path, data.dtype):
        return [SourceSpec(data.path, 1.0, data.dtype, data.loc, {"path": data.locs.get("path", data.loc)})]
    return []


def _names(specs: list[SourceSpec]) -> list[str]:
    names = [Path(s.path).name.removesuffix(".bin").removesuffix(".idx") or f"source{i}"
             for i, s in enumerate(specs)]
    return [n if names.count(n) == 1 else f"{n}#{i}" for i, n in enumerate(names)]


def open_feed(data: DataSpec, ev: EvalSpec, seed: int, global_batch: int, seq_len: int,
              model_vocab: int | None) -> TokenFeed | None:
    """The mixture of token sources the plan names, each opened (memory-mapped) and checked
    against the model and the tokenizer; None when the plan reads text or bytes. Raises
    PlanErrors for a mistake in the plan, DataError (one line, naming the file) in the data."""
    specs = token_sources(data)
    if not specs:
        return None
    errs = ErrorList()
    for s in specs:
        if not Path(data.resolved(s.path)).exists() and not Path(data.resolved(s.path) + ".idx").exists():
            errs.add(f"data source '{s.path}' does not exist (a token store folder, a Megatron prefix "
                     f"or a file of ids)", s.locs.get("path", s.loc))
    if ev.fraction is not None:
        errs.add("eval.fraction is not supported with token sources (data.sources, a store, a Megatron "
                 "prefix or data.dtype): hold the data out as its own source and name it eval.path",
                 ev.locs.get("fraction", ev.loc))
    eval_path = ev.path and data.resolved(ev.path)
    if eval_path is not None and not Path(eval_path).exists() and not Path(eval_path + ".idx").exists():
        errs.add(f"eval.path '{ev.path}' does not exist (a token store folder, a Megatron prefix or a "
                 f"file of ids with data.dtype)", ev.locs.get("path", ev.loc))
    errs.raise_if_any()
    identity = _tokenizer(data, model_vocab).identity() if data.tokenizer is not None else None
    sources = []
    for name, s in zip(_names(specs), specs):
        tf = open_tokens(data.resolved(s.path), s.dtype or data.dtype)
        check_source(tf, model_vocab, identity, seq_len)
        sources.append(Source(name, tf, s.weight))
    feed = TokenFeed(sources, seed, global_batch, seq_len)
    if eval_path is not None:
        feed.held_out = _held_out(eval_path, ev, data, model_vocab, identity, global_batch, seq_len)
    return feed


def _held_out(path: str, ev: EvalSpec, data: DataSpec, model_vocab: int | None, identity: str | None,
              global_batch: int, seq_len: int) -> HeldOut:
    """``eval.path`` opened like a training source (``data.dtype`` for a flat file), checked
    the same way, and holding at least one global batch of windows."""
    tf = open_tokens(path, data.dtype)
    check_source(tf, model_vocab, identity, seq_len)
    if tf.windows(seq_len) < global_batch:
        errs = ErrorList()
        errs.add(f"the held-out data {path} has {tf.windows(seq_len)} windows of {seq_len} tokens, fewer "
                 f"than one global batch of {global_batch}", ev.locs.get("path", ev.loc))
        errs.raise_if_any()
    return HeldOut("eval", tf, seq_len)


def data_plan(plan_path: str, overrides: list[str], world: int) -> list[str]:
    """For ``tpplan validate``: what a plan on token sources will eat (tokens available,
    consumed, epochs per source), or the data's mistake; empty for text or bytes."""
    from ..api import load

    plan = load(plan_path, overrides)
    if not token_sources(plan.data):
        return []
    try:
        feed = open_feed(plan.data, plan.eval, plan.train.seed, plan.step_shape(world).global_batch,
                         plan.train.seq_len, None)
    except (DataError, PlanErrors) as e:
        return [f"data: error: {e}"]
    return feed.plan_lines(plan.train.steps) if feed is not None else []
