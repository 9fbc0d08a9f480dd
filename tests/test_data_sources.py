"""Token sources on disk (docs/data.md): Megatron-Core indexed datasets read equal to
megatron-core's own reader, flat files with a stated dtype, the token store ``tpplan data
prepare`` writes (the same bytes for 1 or 2 workers, and after a kill and a restart), the
mixture's shares and its purity in (seed, step), and each kind of bad data as one line
naming its file; a run's token cache made by worker processes into the store ``data prepare``
makes (and one 1-process ``tpplan train`` on it). The multi-rank training runs are in
tests/test_data_train.py.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import PLANS, run_main, tpplan_cli
from hooked import KILL_PREPARE
from tpplan.data.errors import DataError
from tpplan.data.feed import Source, TokenFeed
from tpplan.data.formats import open_tokens
from tpplan.data.scan import check_source
from tpplan.plan import PlanErrors
from tpplan.train.corpora import open_feed

megatron = pytest.importorskip("megatron.core.datasets.indexed_dataset")


def _megatron(prefix: Path, docs: list[list[int]], dtype=np.uint16) -> None:
    builder = megatron.IndexedDatasetBuilder(str(prefix) + ".bin", dtype=dtype)
    for d in docs:
        builder.add_item(torch.tensor(d))
        builder.end_document()
    builder.finalize(str(prefix) + ".idx")


def _docs(n: int, seed: int = 0, high: int = 500) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, high, int(rng.integers(1, 60))).tolist() for _ in range(n)]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_documents_equal_megatron_cores_reader(tmp_path, dtype):
    prefix = tmp_path / "corpus_text_document"
    _megatron(prefix, _docs(200), dtype)
    theirs = megatron.IndexedDataset(str(prefix))
    ours = open_tokens(str(prefix), None)  # the prefix, as Megatron names it; no dtype needed
    assert ours.kind == "megatron" and ours.documents == len(theirs) == 200
    for i in range(len(theirs)):
        assert np.array_equal(ours.document(i), theirs[i].astype(np.int64)), i
    assert isinstance(ours.tokens.arrays[0].base.obj, mmap.mmap)  # mapped, never read whole
    # a window's positions restart where Megatron's documents start
    ids, _, positions = ours.window(3, 64)
    starts = set(np.cumsum([0] + [len(theirs[i]) for i in range(len(theirs))]).tolist())
    assert [p == 0 for p in positions[1:]] == [3 * 64 + j in starts for j in range(1, 65)]
    assert np.array_equal(open_tokens(str(prefix) + ".bin", None).document(7), ours.document(7))


def test_megatron_documents_of_several_sequences_cost_one_pointer_each(tmp_path, monkeypatch):
    """Sentence-split data (``preprocess_data.py --split-sentences``): a document is several
    sequences. It reads as the concatenation of megatron-core's sequences for it, and the rank
    holds one int64 per document (its first sequence's pointer), gathered a block at a time."""
    import tpplan.data.megatron as reader

    monkeypatch.setattr(reader, "BLOCK", 7)  # several blocks, one cut inside a run of documents
    prefix = tmp_path / "split_text_sentence"
    builder = megatron.IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.uint16)
    rng = np.random.default_rng(2)
    for _ in range(50):
        for _ in range(int(rng.integers(1, 5))):
            builder.add_item(torch.tensor(rng.integers(0, 500, int(rng.integers(1, 20)))))
        builder.end_document()
    builder.finalize(str(prefix) + ".idx")
    theirs = megatron.IndexedDataset(str(prefix))
    ours = open_tokens(str(prefix), None)
    bounds = theirs.document_indices
    assert ours.documents == 50 and len(theirs) > 60  # more sequences than documents
    for d in range(50):
        whole = np.concatenate([theirs[j] for j in range(bounds[d], bounds[d + 1])]).astype(np.int64)
        assert np.array_equal(ours.document(d), whole), d
    (_, starts, _), = ours.starts.pieces
    assert starts.dtype == np.int64 and starts.shape == (50,) and starts.base is None  # its own, 8 bytes a document


def test_truncated_megatron_files_are_named(tmp_path):
    prefix = tmp_path / "c"
    _megatron(prefix, _docs(50))
    bin_, idx = Path(str(prefix) + ".bin"), Path(str(prefix) + ".idx")
    data = bin_.read_bytes()
    bin_.write_bytes(data[:-6])
    with pytest.raises(DataError, match=rf"^{bin_}: .*bytes, but c.idx says .* \(truncated\)$"):
        open_tokens(str(prefix), None)
    bin_.write_bytes(data)
    idx.write_bytes(idx.read_bytes()[:-16])
    with pytest.raises(DataError, match=rf"^{idx}: truncated: "):
        open_tokens(str(prefix), None)


def test_flat_file_dtype_is_stated_and_checked(tmp_path):
    f = tmp_path / "train.bin"
    np.arange(70_000, 70_000 + 1001, dtype=np.uint32).tofile(f)
    with pytest.raises(DataError, match=rf"^{f}: a file of token ids needs its dtype stated"):
        open_tokens(str(f), None)
    t = open_tokens(str(f), "uint32")
    assert len(t) == 1001 and isinstance(t.tokens.arrays[0].base.obj, mmap.mmap)
    ids, mask, positions = t.window(2, 100)
    assert ids.tolist() == list(range(70_200, 70_301)) and mask is None and positions is None
    f.write_bytes(f.read_bytes()[:-2])
    with pytest.raises(DataError, match=r"is not a whole number of uint32 ids .* data.dtype right"):
        open_tokens(str(f), "uint32")


def test_bad_data_is_one_line_naming_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("TPPLAN_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "ids.bin"
    np.array([1, 2, 3] * 100 + [70_000], dtype=np.uint32).tofile(f)
    t = open_tokens(str(f), "uint32")
    with pytest.raises(DataError, match=rf"^{f}: holds token id 70000, past the model's vocabulary of 65536"):
        check_source(t, 65536, None, 16)
    check_source(open_tokens(str(f), "uint32"), 128_256, None, 16)  # the scan, cached by size and mtime
    assert json.loads((tmp_path / "cache" / "largest-ids.json").read_text()) == {
        f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}:uint32": 70_000}
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match=rf"^{empty}: 0 tokens, fewer than one sequence"):
        check_source(open_tokens(str(empty), "uint16"), 256, None, 16)


def test_sources_weights_are_checked_in_the_plan(tmp_path):
    from tpplan import load

    plan = tmp_path / "p.yaml"
    plan.write_text("model: {name: llama3, config: debug}\ndata:\n  sources:\n"
                    "    - {path: a.bin, weight: -1, dtype: uint8}\n    - {path: b.bin, weight: 0}\n")
    with pytest.raises(PlanErrors) as e:
        load(str(plan))
    text = str(e.value)
    assert f"{plan}:4:29: 'data.sources[0].weight' must be at least 0, got -1.0" in text
    assert f"{plan}:4:40: 'data.sources[0].dtype' must be one of uint16, uint32, int32" in text
    assert f"{plan}:4:5: 'data.sources' has no positive weight: no source would be drawn" in text
    plan.write_text("model: {name: llama3, config: debug}\ndata: {path: t.txt, tokenizer: tok, workers: 0}\n")
    with pytest.raises(PlanErrors, match=rf"{plan}:2:46: 'data.workers' must be at least 1, got 0"):
        load(str(plan))
    plan.write_text("model: {name: llama3, config: debug}\ndata: {path: t.txt, workers: two}\n")
    with pytest.raises(PlanErrors, match=rf"{plan}:2:30: 'data.workers' must be"):
        load(str(plan))
    plan.write_text("model: {name: llama3, config: debug}\ndata: {path: t.txt, workers: 2}\n")
    with pytest.raises(PlanErrors, match=rf"{plan}:2:30: 'data.workers' needs 'data.tokenizer'"):
        load(str(plan))


def _flat(tmp_path: Path, name: str, n: int, offset: int) -> Path:
    f = tmp_path / f"{name}.bin"
    (np.arange(n, dtype=np.uint32) % 1000 + offset).astype(np.uint32).tofile(f)
    return f


def test_mixture_shares_match_weights_and_are_a_pure_function_of_seed_and_step(tmp_path):
    weights = [0.5, 0.3, 0.2]
    sizes = [20_001, 3_201, 50_001]  # the small one wraps several times
    sources = [Source(f"s{i}", open_tokens(str(_flat(tmp_path, f"s{i}", n, 0)), "uint32"), w)
               for i, (n, w) in enumerate(zip(sizes, weights))]
    feed = TokenFeed(sources, seed=3, batch=20, seq_len=16)
    draws = [feed.draw(step) for step in range(1, 101)]  # 2,000 samples
    src = np.concatenate([d[0] for d in draws])
    share = np.bincount(src, minlength=3) / len(src)
    assert np.abs(share - weights).max() <= 0.01, share
    # each source's windows: every one once an epoch, then a new order
    for s, n in enumerate(feed.windows):
        seen = np.concatenate([d[1][d[0] == s] for d in draws])
        for e in range(len(seen) // n):
            assert sorted(seen[e * n:(e + 1) * n].tolist()) == list(range(n))
        if len(seen) >= 2 * n:
            assert not np.array_equal(seen[:n], seen[n:2 * n])
    # pure: a step drawn alone (a resumed run) equals the same step drawn in sequence, and
    # any dp degree's slices make up the same global batch
    again = TokenFeed(sources, seed=3, batch=20, seq_len=16)
    assert all(np.array_equal(a, b) for a, b in zip(again.draw(57), draws[56]))
    whole = again.batch(57, 0, 1).tokens
    halves = torch.cat([again.batch(57, r, 2).tokens for r in range(2)])
    quarters = torch.cat([again.batch(57, r, 4).tokens for r in range(4)])
    assert torch.equal(whole, halves) and torch.equal(whole, quarters)
    again.close()
    used = feed.used(100)
    assert [t for t, _ in used] == [int(c) * 16 for c in np.bincount(src, minlength=3)]
    assert used[1][1] > 2  # the small source wrapped
    assert any("s1 ran out of windows and wraps" in n for s in range(1, 101) for n in feed.wraps(s))


def _shard_hashes(store: Path) -> dict[str, str]:
    return {p.relative_to(store).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(store.rglob("*")) if p.is_file() and p.name != "prepare.json"}


def _texts(folder: Path, n: int) -> Path:
    folder.mkdir()
    rng = np.random.default_rng(1)
    words = ["data", "token", "shard", "mesh", "plan", "rank", "loss", "store", "epoch", "weight"]
    for i in range(n):
        (folder / f"doc{i:03d}.txt").write_text(" ".join(rng.choice(words, int(rng.integers(5, 80)))))
    return folder


def test_prepare_killed_and_restarted_makes_the_same_store_as_1_or_2_workers(tmp_path, tiny_llama, capsys):
    from tpplan.data.prepare import PrepareJob, prepare

    texts = _texts(tmp_path / "texts", 60)
    job = PrepareJob(str(texts), str(tmp_path / "one"), str(tiny_llama), docs_per_shard=6)
    prepare(job)  # one worker, in this process
    args = ["data", "prepare", texts, "--tokenizer", tiny_llama, "--docs-per-shard", "6"]
    two = tpplan_cli(*args, "--output", tmp_path / "two", "--workers", "2", check=True)
    assert "60 documents" in two.stdout and "10 shards (10 made)" in two.stdout
    killed = tpplan_cli(*args, "--output", tmp_path / "again", env={KILL_PREPARE: "4"})
    assert killed.returncode == -9
    assert not (tmp_path / "again" / "tokens.json").exists()
    assert len(list((tmp_path / "again" / "shards").glob("*.json"))) == 4
    restarted = prepare(PrepareJob(**{**job.__dict__, "output": str(tmp_path / "again")}))
    assert (restarted.made, restarted.kept) == (6, 4)
    one = _shard_hashes(tmp_path / "one")
    assert len([n for n in one if n.endswith(".ids")]) == 10
    assert one == _shard_hashes(tmp_path / "two") == _shard_hashes(tmp_path / "again")
    store = open_tokens(str(tmp_path / "one"), None)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_llama / "tokenizer.json"))
    first = (texts / "doc000.txt").read_text()
    assert store.document(0)[:-1].tolist() == tok.encode(first, add_special_tokens=False).ids
    rc, out = run_main(capsys, "data", "prepare", texts, "--tokenizer", tiny_llama, "--output", tmp_path / "one")
    assert rc == 1 and "holds a prepare of other inputs, tokenizer or settings" in out


def test_store_of_another_tokenizer_and_an_eval_section_are_refused(tmp_path, tiny_llama):
    from tpplan.data.prepare import PrepareJob, prepare
    from tpplan.plan.specs import DataSpec, EvalSpec

    texts = _texts(tmp_path / "texts", 4)
    prepare(PrepareJob(str(texts), str(tmp_path / "store"), str(tiny_llama)))
    other = tmp_path / "other-tokenizer"
    other.mkdir()
    spec = json.loads((tiny_llama / "tokenizer.json").read_text())
    spec["added_tokens"] = spec["added_tokens"] + [dict(spec["added_tokens"][0], id=512, content="<x>")]
    (other / "tokenizer.json").write_text(json.dumps(spec))
    data = DataSpec(path=str(tmp_path / "store"), tokenizer=str(other / "tokenizer.json"))
    with pytest.raises(DataError, match=rf"^{tmp_path / 'store'}: made with another tokenizer"):
        open_feed(data, EvalSpec(), 0, 4, 16, 1024)
    with pytest.raises(PlanErrors, match="eval.fraction is not supported with token sources"):
        open_feed(DataSpec(path=str(tmp_path / "store")), EvalSpec(fraction=0.1), 0, 4, 16, 1024)
    assert os.path.getsize(tmp_path / "store" / "tokens.json") > 0


def test_a_max_bytes_cap_that_cuts_data_is_stated(tmp_path):
    from tpplan.plan.specs import DataSpec, EvalSpec
    from tpplan.train.corpora import load_corpora

    text = tmp_path / "a.txt"
    text.write_text("x" * 500)
    cut = load_corpora(DataSpec(path=str(text), max_bytes=100), EvalSpec(), tmp_path / "run", 256, 16)
    assert len(cut.train) == 100
    assert [n for n in cut.notes if n.startswith("data.max_bytes=100 cut train data")]
    whole = load_corpora(DataSpec(path=str(text), max_bytes=1000), EvalSpec(), tmp_path / "run", 256, 16)
    assert len(whole.train) == 500 and not whole.notes


def test_a_runs_token_cache_is_a_store_a_later_run_reads(tmp_path, tiny_llama):
    """A run with data.tokenizer leaves a token store (the format ``data prepare`` writes) in
    its run folder, memory-mapped, not copied: chats with the assistant-only mask, each
    document followed by the separator -- the tokens the per-run cache always made. A second
    run reuses it, and a run naming it as ``data.path`` trains on the same tokens."""
    from transformers import AutoTokenizer

    from tpplan.plan.specs import DataSpec, EvalSpec
    from tpplan.train.cache import CACHE_DIR
    from tpplan.train.chat import render_chat
    from tpplan.train.corpora import load_corpora

    hf = AutoTokenizer.from_pretrained(str(tiny_llama))
    sep = hf.convert_tokens_to_ids("<|im_end|>")
    ids, mask, lengths = [], [], []
    for n, line in enumerate((tiny_llama / "chat.jsonl").read_text().splitlines(), 1):
        i, m = render_chat(hf, json.loads(line)["messages"], f"chat.jsonl:{n}")
        ids, mask = ids + i + [sep], mask + m + [False]  # what the int32 cache held
        lengths.append(len(i) + 1)
    data = DataSpec(path=str(tiny_llama / "chat.jsonl"), tokenizer=str(tiny_llama))
    first = load_corpora(data, EvalSpec(), tmp_path / "run", 512, 16)
    assert first.train.tokens.tolist() == ids and first.train.mask.tolist() == mask
    assert first.train.tokens.dtype == torch.uint16 and first.train.separator == sep
    store = tmp_path / "run" / CACHE_DIR / "train"
    ptr = first.train.tokens.data_ptr()  # in a mapping of the store's shard: never an int64 copy
    spans = [line.split()[0].split("-") for line in Path("/proc/self/maps").read_text().splitlines()
             if line.endswith(str(store / "shards" / "00000.ids"))]
    assert any(int(lo, 16) <= ptr < int(hi, 16) for lo, hi in spans)
    record = json.loads((store.parent / "train.json").read_text())
    again = load_corpora(data, EvalSpec(), tmp_path / "run", 512, 16)
    assert json.loads((store.parent / "train.json").read_text())["made_at"] == record["made_at"]
    assert again.train.tokens.tolist() == ids  # mapped again, not re-tokenized
    feed = open_feed(DataSpec(path=str(store), tokenizer=str(tiny_llama)), EvalSpec(), 0, 4, 16, 512)
    (source,) = feed.sources
    assert source.file.kind == "store" and source.file.documents == len(lengths)
    assert source.file.tokens.read(0, len(ids)).tolist() == ids
    assert source.file.mask.read(0, len(ids)).astype(bool).tolist() == mask
    assert [len(source.file.document(d)) for d in range(len(lengths))] == lengths  # the boundaries
    feed.close()


def test_negative_ids_float_megatron_data_and_stray_carriage_returns(tmp_path):
    """Dtype edges said in one line naming the file: a negative id in a signed flat file, a
    Megatron dataset of floats; a stray \\r inside a .jsonl line is no new record for prepare."""
    from tpplan.data.units import plan_units, unit_documents

    ids = np.arange(40, dtype=np.int32)
    ids[7] = -3
    ids.tofile(tmp_path / "signed.bin")
    with pytest.raises(DataError, match=rf"^{tmp_path / 'signed.bin'}: holds token id -3, a negative id"):
        check_source(open_tokens(str(tmp_path / "signed.bin"), "int32"), 512, None, 16)
    _megatron(tmp_path / "floats", [[1.5, 2.5, 3.5]], dtype=np.float32)
    with pytest.raises(DataError, match=rf"^{tmp_path / 'floats.idx'}: a Megatron dataset of float32"):
        open_tokens(str(tmp_path / "floats"), None)
    (tmp_path / "r.jsonl").write_bytes(b'{"text": "a"}\r\n{"text":\r "b"}\n{"text": "d"}\n')  # \r: JSON whitespace
    docs = [d.value for u in plan_units(tmp_path / "r.jsonl", "auto", 2) for d in unit_documents(u, "auto", "text")]
    assert docs == ["a", "b", "d"]
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.table({"text": [f"row{i}" for i in range(10)]}), tmp_path / "t.parquet", row_group_size=3)
    units = plan_units(tmp_path / "t.parquet", "auto", 4)  # units across row groups: each read once
    assert [d.value for u in units for d in unit_documents(u, "auto", "text")] == [f"row{i}" for i in range(10)]


def test_the_runs_token_cache_is_made_by_workers_into_the_store_data_prepare_makes(tmp_path, tiny_llama):
    """A ``.jsonl`` of 20,500 records (three units of 10,000): a run's token cache made by 2
    worker processes (``data.workers``) is the same shards as by 1 and as ``tpplan data
    prepare`` makes of the same input; the trainer reads the three shards as one stream from
    their maps (a held-out split across a shard boundary too); and ``tpplan train`` making its
    own cache with 2 workers trains on it, each step's batch the corpus's function of (seed, step)."""
    from tpplan.data.prepare import PrepareJob, prepare
    from tpplan.plan.specs import DataSpec, EvalSpec
    from tpplan.train.cache import CACHE_DIR
    from tpplan.train.corpora import load_corpora
    from tpplan.train.data import Corpus, step_batch
    from tpplan.train.joined import Joined
    from hooked import RECORD_BATCHES

    rng = np.random.default_rng(3)
    words = ["data", "token", "shard", "mesh", "plan", "rank", "loss", "store", "epoch", "weight"]
    src = tmp_path / "records.jsonl"
    src.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, int(rng.integers(1, 6))))}) + "\n"
                           for _ in range(20_500)))
    made = {w: load_corpora(DataSpec(path=str(src), tokenizer=str(tiny_llama), workers=w, max_bytes=1 << 30),
                            EvalSpec(), tmp_path / f"run{w}", 512, 16) for w in (2, 1)}
    prepare(PrepareJob(str(src), str(tmp_path / "prepared"), str(tiny_llama)))
    stores = [tmp_path / f"run{w}" / CACHE_DIR / "train" for w in (2, 1)]
    hashes = _shard_hashes(tmp_path / "prepared")
    assert len([n for n in hashes if n.endswith(".ids")]) == 3
    assert _shard_hashes(stores[0]) == _shard_hashes(stores[1]) == hashes
    assert "(3 shard(s) by 2 process(es) in" in made[2].notes[0]
    assert "(3 shard(s) by 1 process(es) in" in made[1].notes[0]
    c = made[2].train
    assert isinstance(c.tokens, Joined) and c.mask is None
    whole = torch.from_numpy(open_tokens(str(stores[0]), None).tokens.read(0, len(c)))
    assert len(c) == len(whole) == json.loads((stores[0] / "tokens.json").read_text())["tokens"]
    first = json.loads((stores[0] / "shards" / "00000.json").read_text())["tokens"]
    idx = torch.tensor([[0, 1, 2], [first - 1, first, first + 1], [len(c) - 3, len(c) - 2, len(c) - 1]])
    assert torch.equal(c.tokens[idx], whole[idx])
    ref = Corpus(whole, c.vocab_size, c.source, None, True, c.separator)
    for step in (1, 2, 3):
        assert torch.equal(step_batch(c, 0, step, 8, 16, 0, 1).tokens, step_batch(ref, 0, step, 8, 16, 0, 1).tokens)
    cut = (first // 16) * 16  # a split whose held-out part starts in the first shard
    held = Corpus(c.tokens[cut:], c.vocab_size, c.source, None, True, c.separator)
    assert len(held) == len(c) - cut and torch.equal(held.tokens[torch.arange(len(held))], whole[cut:])
    run = tmp_path / "trained"
    sets = [f"data.path={src}", f"data.tokenizer={tiny_llama}", "data.workers=2", "data.max_bytes=1073741824",
            "mesh.tp=1", "model.kwargs.n_layers=1", "model.kwargs.dim=16", "model.kwargs.n_heads=2",
            "model.kwargs.n_kv_heads=1", "model.kwargs.vocab_size=512", "train.steps=2", "train.seq_len=16",
            "train.global_batch_size=8", "checkpoint.enabled=false", f"metrics.run_dir={run}"]
    proc = tpplan_cli("train", "--plan", PLANS / "llama.yaml", *[a for s in sets for a in ("--set", s)],
                      env={RECORD_BATCHES: "1"}, check=True)
    assert "(3 shard(s) by 2 process(es) in" in proc.stdout
    assert _shard_hashes(run / CACHE_DIR / "train") == hashes
    digests = [json.loads(line) for line in (run / "batches" / "rank0.jsonl").read_text().splitlines()]
    assert [d["digest"] for d in digests] == [
        hashlib.sha256(step_batch(ref, 0, s, 8, 16, 0, 1).tokens.numpy().tobytes()).hexdigest()[:16] for s in (1, 2)]


def test_closing_a_feed_unmaps_its_sources(tmp_path, tiny_llama):
    """``TokenFeed.close`` stops the background reads and unmaps every file the feed maps --
    a store's ids, document starts and loss mask, a Megatron ``.bin`` and ``.idx``, the
    held-out source -- so the rank holds none of them after (``/proc/self/maps``); a second
    close does nothing, and a batch after it is refused."""
    from tpplan.data.prepare import PrepareJob, prepare
    from tpplan.plan.specs import DataSpec, EvalSpec, SourceSpec

    chats = tmp_path / "chats"
    chats.mkdir()
    (chats / "c.jsonl").write_text((tiny_llama / "chat.jsonl").read_text())
    prepare(PrepareJob(str(chats), str(tmp_path / "store"), str(tiny_llama)))
    _megatron(tmp_path / "web", _docs(200))
    _megatron(tmp_path / "held", _docs(100, seed=1))
    data = DataSpec(sources=[SourceSpec(str(tmp_path / "store"), 0.5), SourceSpec(str(tmp_path / "web"), 0.5)])
    feed = open_feed(data, EvalSpec(path=str(tmp_path / "held")), 0, 4, 16, 512)
    feed.batch(1, 0, 1)  # the next steps' windows now read in the background

    def mapped() -> set[str]:
        names = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()}
        return {n for n in names if n.startswith(str(tmp_path))}

    before = mapped()
    assert {"store/shards/00000.ids", "store/shards/00000.docs", "store/shards/00000.mask", "web.bin", "web.idx",
            "held.bin", "held.idx"} <= {str(Path(n).relative_to(tmp_path)) for n in before}
    maps = [m for s in feed.sources for m in s.file.tokens.maps if m is not None]
    feed.close()
    assert mapped() == set() and maps and all(mm.closed for mm, _ in maps)
    feed.close()
    with pytest.raises(RuntimeError, match="the token feed is closed"):
        feed.batch(2, 0, 1)


def test_an_output_inside_its_input_is_refused_before_any_work(tmp_path, tiny_llama, capsys):
    """``data prepare`` reads every file under its input: a store written inside it would be
    read as input by the next prepare (or a restart, whose key would no longer match). Refused
    in one line naming both folders, nothing written; the same for a run's token cache when
    ``data.path`` is a folder holding the run folder."""
    from tpplan.plan.specs import DataSpec, EvalSpec
    from tpplan.train.corpora import load_corpora

    texts = _texts(tmp_path / "texts", 3)
    for out in (texts / "store", texts):
        rc, printed = run_main(capsys, "data", "prepare", texts, "--tokenizer", tiny_llama, "--output", out)
        assert rc == 1 and printed.strip() == (
            f"error: {out}: the output folder is inside the input folder {texts}; its shards would be read as "
            f"input by a later or restarted prepare: choose an output outside {texts}")
    assert sorted(p.name for p in texts.iterdir()) == ["doc000.txt", "doc001.txt", "doc002.txt"]
    with pytest.raises(DataError, match=rf"^{texts / 'run' / 'tokens' / 'train'}: the output folder is inside"):
        load_corpora(DataSpec(path=str(texts), tokenizer=str(tiny_llama)), EvalSpec(), texts / "run", 512, 16)
    assert not (texts / "run").exists()
