"""``tpplan data prepare``: tokenize a corpus into a token store, in parallel, resumably.

    tpplan data prepare corpus/ --tokenizer tok/ --output store/ --workers 8

Text files, ``.jsonl`` / ``.parquet`` records (``--text-field``), chats (``messages``
lists, rendered with the tokenizer's chat template; only the assistant's tokens are loss
targets) and HuggingFace ``datasets`` folders (``save_to_disk``). Killed and run again with
the same arguments, it keeps the shards it finished. Train on the store with
``data.path: store/`` or ``data.sources: [{path: store/, weight: 1}]`` (docs/data.md).
"""

from __future__ import annotations

import argparse
import sys
import time

FORMATS = ("auto", "text", "jsonl", "parquet", "chat", "hf")


def register(sub) -> None:
    p = sub.add_parser("data", help="prepare token data for training (docs/data.md)",
                       description="Token data for tpplan train (docs/data.md).")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    q = actions.add_parser("prepare", help="tokenize text, jsonl, parquet, chats or a datasets "
                           "folder into a token store", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    q.add_argument("input", help="a file or folder of text / .jsonl / .parquet, or a datasets "
                   "save_to_disk folder")
    q.add_argument("--tokenizer", required=True, help="a tokenizer.json or a HF model/tokenizer folder")
    q.add_argument("-o", "--output", required=True, help="the token store folder to write")
    q.add_argument("--workers", type=int, default=1, help="tokenizing processes (default 1)")
    q.add_argument("--format", choices=FORMATS, default="auto",
                   help="how to read the input (auto: by each file's suffix; a datasets folder "
                        "is found by its state.json)")
    q.add_argument("--text-field", default="text", help="the record field holding the text")
    q.add_argument("--separator", default=None, help="the token ending each document (default: "
                   "the tokenizer's end-of-text)")
    q.add_argument("--docs-per-shard", type=int, default=10_000,
                   help="documents per shard, the unit of work and of restart (default 10000)")
    q.add_argument("--overwrite", action="store_true",
                   help="replace a store made from other inputs or settings")
    q.set_defaults(run=run)


def _bar(out):
    """A progress callback: documents, tokens, tokens/s and the ETA by shards done."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(TextColumn("prepare"), BarColumn(), TextColumn("{task.completed}/{task.total} shards"),
                   TextColumn("{task.fields[info]}"), TimeRemainingColumn(), console=out, transient=False)
    state = {"task": None, "t0": time.perf_counter(), "start_tokens": None}

    def update(done: int, total: int, docs: int, tokens: int) -> None:
        if state["task"] is None:
            bar.start()
            state["task"] = bar.add_task("prepare", total=total, completed=done, info="")
            state["start_tokens"] = tokens
        rate = (tokens - state["start_tokens"]) / max(time.perf_counter() - state["t0"], 1e-9)
        bar.update(state["task"], completed=done,
                   info=f"{docs:,} docs  {tokens:,} tokens  {rate:,.0f} tokens/s")
    return bar, update


def run(args: argparse.Namespace) -> int:
    from ..data.errors import DataError
    from ..data.prepare import PrepareJob, prepare
    from ._common import console

    if args.workers < 1 or args.docs_per_shard < 1:
        print("error: --workers and --docs-per-shard must be at least 1", file=sys.stderr)
        return 2
    job = PrepareJob(args.input, args.output, args.tokenizer, args.format, args.text_field,
                     args.separator, args.docs_per_shard)
    out = console(120)
    bar, update = _bar(out)
    try:
        done = prepare(job, args.workers, args.overwrite, update)
    except DataError as e:
        bar.stop()
        print(f"error: {e}", file=sys.stderr)
        return 1
    bar.stop()
    m = done.manifest
    kept = f", {done.kept} kept from an earlier run" if done.kept else ""
    loss = f", {m['loss_tokens']:,} loss targets" if m["masked"] else ""
    out.print(f"{args.output}: {m['documents']:,} documents, {m['tokens']:,} tokens ({m['dtype']}, "
              f"largest id {m['max_token']}{loss}) "
              f"in {len(m['shards'])} shards ({done.made} made{kept}) in {done.seconds:.1f} s "
              f"with {args.workers} worker(s)")
    return 0
