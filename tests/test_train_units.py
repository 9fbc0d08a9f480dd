"""Fast, single-process promises of the trainer: data, schedule, config, checkpoint picking."""

from __future__ import annotations

import itertools
import os
import tracemalloc

import numpy as np
import pytest
import torch
from helpers import PLANS

import tpplan
from tpplan.checkpoint import latest
from tpplan.models import init_weights
from tpplan.plan.errors import PlanErrors
from tpplan.train import clip_grad_norm, lr_lambda
from tpplan.train.data import global_batch, load_corpus, local_batch

PLAN = PLANS / "llama.yaml"


def test_default_corpus_is_stdlib_bytes_and_deterministic():
    a, b = load_corpus(None, 100_000), load_corpus(None, 100_000)
    assert len(a) == 100_000 and a.vocab_size == 256 and "stdlib" in a.source
    assert torch.equal(a.tokens, b.tokens)


def test_local_batches_depend_only_on_dp_rank_and_tile_the_global_batch():
    corpus = load_corpus(None, 50_000)
    full = global_batch(corpus, seed=3, step=7, batch=8, seq_len=16)
    assert full.shape == (8, 17)
    for dp in (1, 2, 4):
        parts = [local_batch(corpus, 3, 7, 8, 16, r, dp) for r in range(dp)]
        assert torch.equal(torch.cat(parts), full)  # any mesh shape sees the same global batch
    assert not torch.equal(global_batch(corpus, 3, 8, 8, 16), full)


def test_text_folder_and_bin_sources(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"hello ")
    (tmp_path / "b.txt").write_bytes(b"world")
    assert bytes(load_corpus(str(tmp_path), 1000).tokens.to(torch.uint8).tolist()) == \
        b"hello world"
    np.arange(1000, 1100, dtype=np.uint16).tofile(tmp_path / "t.bin")
    c = load_corpus(str(tmp_path / "t.bin"), 1000)
    assert c.tokens[0] == 1000 and len(c) == 100 and c.vocab_size == 1100


def _bytes_read() -> int:
    """What this process has read through read() so far (Linux's /proc/self/io rchar)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux's /proc/self/io")
def test_a_big_text_file_is_read_only_up_to_max_bytes(tmp_path):
    """A 600 MB text file under the default 4 MB cap: about 4 MB read and held, not 600."""
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.write(b"the quick brown fox jumps over the lazy dog\n" * 200)
        f.truncate(600 * 2**20)  # sparse: the rest reads as NULs, past the binary probe
    (tmp_path / "z.txt").write_bytes(b"never reached")
    cap = 4_000_000
    tracemalloc.start()
    before = _bytes_read()
    corpus = load_corpus(str(tmp_path), cap)
    read = _bytes_read() - before
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(corpus) == cap
    assert bytes(corpus.tokens[:9].to(torch.uint8).tolist()) == b"the quick"
    assert cap <= read < cap + 64 * 1024  # the cap, and a little for the reads around it
    assert peak < 16 * cap  # the bytes, their int64 tokens and a copy; not 600 MB


def test_binary_files_in_a_text_folder_are_skipped_without_reading_them(tmp_path):
    with open(tmp_path / "a.bin.dat", "wb") as f:
        f.write(b"\0binary")
        f.truncate(200 * 2**20)
    (tmp_path / "b.txt").write_bytes(b"text")
    before = _bytes_read() if os.path.exists("/proc/self/io") else None
    assert bytes(load_corpus(str(tmp_path), 1000).tokens.to(torch.uint8).tolist()) == b"text"
    if before is not None:
        assert _bytes_read() - before < 64 * 1024


def test_warmup_then_cosine_to_min_lr():
    f = [lr_lambda(s, warmup=4, total=20, lr=1.0, min_lr=0.1) for s in range(21)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in itertools.pairwise(f[4:]))
    assert f[20] == pytest.approx(0.1)


def test_trainer_sections_defaults_and_located_type_errors():
    with pytest.raises(PlanErrors) as caught:  # parsed with the plan, when it is loaded
        tpplan.load(PLAN, ["train.lr=fast", "checkpoint.keep=-1", "train.betas=[0.9]"])
    msgs = [f"{e.loc.file}:{e.message}" for e in caught.value.errors]
    assert any("'train.lr' must be a number" in m and m.startswith("--set train.lr")
               for m in msgs), msgs
    assert any("'checkpoint.keep' must be at least 0" in m for m in msgs)
    assert any("'train.betas' must be a list of two numbers" in m for m in msgs)
    plan = tpplan.load(PLAN)
    assert plan.train.steps == 200 and plan.data.path is None and plan.checkpoint.interval == 50


def test_unknown_trainer_section_is_an_error():
    with pytest.raises(PlanErrors, match="did you mean 'metrics'"):
        tpplan.load(PLAN, ["metric.log_interval=2"])


def test_latest_skips_tmp_and_incomplete(tmp_path):
    for name, files in (("step-000003", [".metadata", "trainer.pt"]),
                        ("step-000006", [".metadata"]),  # trainer.pt never written
                        ("step-000009.tmp", [".metadata", "trainer.pt"])):
        (tmp_path / name).mkdir()
        for f in files:
            (tmp_path / name / f).write_bytes(b"")
    assert latest(tmp_path).name == "step-000003"


def test_clip_grad_norm_matches_torch_on_plain_tensors():
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))
    a.grad, b.grad = torch.randn(5, 3), torch.randn(7)
    ref_a, ref_b = a.grad.clone(), b.grad.clone()
    ref = torch.linalg.vector_norm(torch.cat([ref_a.flatten(), ref_b]))
    assert clip_grad_norm([a, b], 0.5) == pytest.approx(ref.item(), rel=1e-6)
    torch.testing.assert_close(a.grad, ref_a * 0.5 / (ref.item() + 1e-6))


def test_factory_model_fallback_init_is_seeded_per_module_path():
    def build():
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))

    a, b, c = build(), build(), build()
    assert init_weights(a, 1, "cpu") == "reset_parameters"
    init_weights(b, 1, "cpu")
    init_weights(c, 2, "cpu")
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        assert not torch.equal(pa, pc), name


@pytest.mark.parametrize("train, world", [
    ("", 4),  # no train section: the defaults, the same for both
    ("train: {seq_len: 64, global_batch_size: 16, micro_batch_size: 2}\n", 8),  # accumulation
])
def test_validate_sizes_the_step_train_would_run(tmp_path, monkeypatch, train, world):
    """`tpplan validate --json` reports the seq_len, micro-batch and accumulation that
    `tpplan train` takes at the same world size, read by the same code."""
    import json

    from helpers import tpplan_cli

    from tpplan.train.setup import prepare

    plan = tmp_path / "plan.yaml"
    plan.write_text(f"extends: {PLAN}\n{train or 'train: null'}\n")
    out = tpplan_cli("validate", "--plan", plan, "--world-size", world, "--json", check=True)
    step = json.loads(out.stdout)["step"]
    monkeypatch.setenv("WORLD_SIZE", str(world))
    prep = prepare(str(plan), ["data.max_bytes=10000", f"metrics.run_dir={tmp_path}"], None, False)
    assert (step["seq_len"], step["micro_batch_size"], step["grad_accum"]) == (
        prep.step.seq_len, prep.step.micro_batch, prep.step.grad_accum)
    assert step["grad_accum"] == (2 if train else 1)
