"""Training on token sources on a real gloo mesh (docs/data.md): one mixture of three --
a Megatron-Core indexed dataset written by megatron-core's own builder, a token store
prepared from a HuggingFace ``datasets`` folder, and a flat uint32 file of ids above 65,535
-- trains a Llama with Llama 3's 128,256-entry vocabulary (tiny width) on 2 ranks, is killed
after step 3, and resumes on 1 rank. Every batch each rank trained on is recorded and
compared with the mixture's pure function of (seed, step): the killed run, the resumed run
on another dp size and an uninterrupted run all read the same global batches. A held-out
Megatron dataset (``eval.path``) is evaluated after steps 2 (on 2 ranks) and 4 (on 1): each
loss equals one process's over the same in-order windows, from the checkpoint's weights.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import PLANS, tpplan_cli
from hooked import KILL_AT, RECORD_BATCHES

megatron = pytest.importorskip("megatron.core.datasets.indexed_dataset")
datasets = pytest.importorskip("datasets")

STEPS, BATCH, SEQ = 4, 4, 32
VOCAB = 128_256


def _sources(tmp: Path, tokenizer: Path) -> list[tuple[Path, float, str | None]]:
    from tpplan.data.prepare import PrepareJob, prepare

    rng = np.random.default_rng(0)
    builder = megatron.IndexedDatasetBuilder(str(tmp / "web_text_document.bin"), dtype=np.uint16)
    for _ in range(40):
        builder.add_item(torch.tensor(rng.integers(0, 60_000, int(rng.integers(5, 50)))))
        builder.end_document()
    builder.finalize(str(tmp / "web_text_document.idx"))
    words = ["shard", "mesh", "plan", "rank", "loss", "store", "epoch", "token"]
    texts = [" ".join(rng.choice(words, int(rng.integers(20, 90)))) for _ in range(30)]
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp / "hf-folder"))
    prepare(PrepareJob(str(tmp / "hf-folder"), str(tmp / "books"), str(tokenizer)))
    rng.integers(65_536, VOCAB, 3 * SEQ + 1).astype(np.uint32).tofile(tmp / "code.bin")  # 3 windows
    builder = megatron.IndexedDatasetBuilder(str(tmp / "held_text_document.bin"), dtype=np.int32)
    for _ in range(20):  # held out: ~10 windows, 2 evaluation batches of 4
        builder.add_item(torch.tensor(rng.integers(0, VOCAB, int(rng.integers(5, 30)))))
        builder.end_document()
    builder.finalize(str(tmp / "held_text_document.idx"))
    return [(tmp / "web_text_document", 0.4, None), (tmp / "books", 0.3, None),
            (tmp / "code.bin", 0.3, "uint32")]


def _plan(tmp: Path, sources) -> Path:
    listed = "".join(f"    - {{path: {p}, weight: {w}{f', dtype: {d}' if d else ''}}}\n" for p, w, d in sources)
    plan = tmp / "mixture.yaml"
    plan.write_text(
        f"extends: {PLANS / 'llama.yaml'}\nmesh: {{tp: 1, dp_shard: -1}}\n"
        f"model: {{name: llama3, config: debug, kwargs: {{n_layers: 1, dim: 16, n_heads: 2, n_kv_heads: 1, "
        f"vocab_size: {VOCAB}}}}}\n"
        f"train: {{steps: {STEPS}, seq_len: {SEQ}, global_batch_size: {BATCH}, warmup_steps: 1}}\n"
        f"data:\n  sources:\n{listed}checkpoint: {{interval: 2}}\nmetrics: {{run_dir: {tmp / 'run'}}}\n"
        f"eval: {{path: {tmp / 'held_text_document'}, interval: 2, batches: 2}}\n")
    return plan


def _expected(plan: Path, step: int, dp_rank: int, dp: int) -> str:
    from tpplan import load
    from tpplan.train.corpora import open_feed

    p = load(str(plan))
    feed = open_feed(p.data, p.eval, p.train.seed, BATCH, SEQ, VOCAB)
    tokens = feed.batch(step, dp_rank, dp).tokens
    feed.close()
    return hashlib.sha256(tokens.numpy().tobytes()).hexdigest()[:16]


@pytest.fixture(scope="module")
def mixture_run(tmp_path_factory, tiny_llama):
    tmp = tmp_path_factory.mktemp("mixture")
    plan = _plan(tmp, _sources(tmp, tiny_llama))
    killed = tpplan_cli("train", "--plan", plan, "--nproc", "2",
                        env={RECORD_BATCHES: "1", KILL_AT: "1:3"}, timeout=300)
    resumed = tpplan_cli("train", "--plan", plan, "--nproc", "1", "--resume",
                         env={RECORD_BATCHES: "1"}, timeout=300)
    return plan, tmp / "run", killed, resumed


def test_a_mixture_of_megatron_datasets_and_uint32_sources_trains_a_128k_vocabulary(mixture_run):
    plan, run, killed, resumed = mixture_run
    assert killed.returncode != 0
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    header = killed.stdout
    assert f"data: the run consumes {STEPS} steps × {BATCH} × {SEQ} = {STEPS * BATCH * SEQ:,} tokens" in header
    assert "web_text_document: " in header and "(megatron, uint16)" in header
    assert "books: " in header and "(store, uint16)" in header
    assert "code: 97 tokens (3 windows)" in header and "(flat, uint32)" in header
    assert "data: source code ran out of windows and wraps" in killed.stdout + resumed.stdout
    rows = {json.loads(line)["step"]: json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()}
    assert sorted(rows) == list(range(1, STEPS + 1))
    assert all(math.isfinite(r["loss"]) for r in rows.values())
    assert abs(rows[1]["loss"] - math.log(VOCAB)) < 1.0  # a 128,256-way softmax at the start
    last = rows[STEPS]
    read = {k.split("/")[1]: v for k, v in last.items() if k.startswith("data/") and k.endswith("/tokens")}
    assert sorted(read) == ["books", "code", "web_text_document"]
    assert sum(read.values()) == STEPS * BATCH * SEQ
    assert last["data/code/epochs"] > 1
    assert "data code" in resumed.stdout  # the summary's per-source line


def test_killed_and_resumed_on_another_dp_size_reads_the_same_global_batches(mixture_run):
    plan, run, _, _ = mixture_run
    seen = {}
    for f in sorted((run / "batches").glob("rank*.jsonl")):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            seen.setdefault((r["step"], f.name), []).append(r)
    # steps 1-3 on 2 ranks (dp 2), then 3-4 again from the step-2 checkpoint on 1 rank (dp 1)
    for step in range(1, 4):
        for rank in range(2):
            got = [r for r in seen[(step, f"rank{rank}.jsonl")] if r["dp_rank"] == rank]
            assert got and got[0]["digest"] == _expected(plan, step, rank, 2), (step, rank)
    for step in (3, 4):
        assert seen[(step, "rank0.jsonl")][-1]["digest"] == _expected(plan, step, 0, 1), step


def test_eval_on_a_held_out_source_equals_one_process_over_the_same_windows(mixture_run):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from tpplan import load
    from tpplan.models import build_model, materialize
    from tpplan.parallel.context.sequence import position_kwarg
    from tpplan.train.corpora import open_feed
    from tpplan.train.evaluate import summed_loss

    plan, run, killed, _ = mixture_run
    assert "data: eval: " in killed.stdout and "(megatron, int32), read in order" in killed.stdout
    rows = {json.loads(line)["step"]: json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()}
    p = load(str(plan))
    held = open_feed(p.data, p.eval, p.train.seed, BATCH, SEQ, VOCAB).held_out
    model = build_model(p.model, device="meta", real_buffers=True)
    materialize(model, "cpu")
    name = position_kwarg(model)
    for step in (2, 4):  # 2: evaluated on 2 ranks; 4: on 1, after the resume
        dcp_to_torch_save(run / "checkpoints" / f"step-{step:06d}", run / "weights.pt")
        model.load_state_dict(torch.load(run / "weights.pt", weights_only=False)["model"])
        total = count = 0.0
        with torch.no_grad():
            for i in range(2):
                b = held.eval_batch(i, BATCH, SEQ, 0, 1)
                assert torch.equal(b.tokens, torch.cat([held.eval_batch(i, BATCH, SEQ, r, 2).tokens for r in (0, 1)]))
                logits = model(b.tokens[:, :-1], **{name: b.positions[:, :-1]})
                total += summed_loss(logits, b.tokens, b.mask).item()
                count += b.count
        assert rows[step]["eval_loss"] == pytest.approx(total / count, rel=1e-5), step
