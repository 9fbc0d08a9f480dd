"""Chat fine-tuning on real gloo processes: the tiny HF Llama of ``scripts/make_tiny_hf.py``
on a 2×2 mesh with TP, SP, loss parallel and FSDP2 (and gradient accumulation), against
one-device references computed here from the same weights and the same batch.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers import TEST_PLANS, tpplan_cli
from trainrun import QUICK_START, fails, metrics, ok

import tpplan
from tpplan.models import build_model, init_weights, materialize
from tpplan.train.corpora import load_corpora
from tpplan.train.data import document_positions, eval_batch, step_batch
from tpplan.train.evaluate import summed_loss

PLAN = str(TEST_PLANS / "hf" / "llama-chat.yaml")
STEPS = 12
SEED = 0


def chat_sets(folder: Path, run_dir: Path) -> list[str]:
    return [f"model.hf_config={folder}", f"data.tokenizer={folder}",
            f"data.path={folder / 'chat.jsonl'}", f"eval.path={folder / 'chat-eval.jsonl'}",
            "eval.interval=6", "eval.batches=4", f"train.steps={STEPS}", "train.seq_len=32",
            "train.global_batch_size=4", "train.micro_batch_size=1", f"train.seed={SEED}",
            f"metrics.run_dir={run_dir}"]


def train(sets: list[str], *extra: str, nproc: int | None = None):
    args = ["train", "--plan", PLAN, *extra]
    for s in [*QUICK_START, *sets]:
        args += ["--set", s]
    return tpplan_cli(*args, *(["--nproc", nproc] if nproc else []), timeout=240)


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory, tiny_llama) -> tuple[Path, list[str], str]:
    d = tmp_path_factory.mktemp("chat") / "2x2"
    sets = chat_sets(tiny_llama, d)
    proc = train(sets, nproc=4)
    ok(proc)
    return d, sets, proc.stdout


def _reference(sets: list[str], run_dir: Path):
    """The plan's model on one process with the trainer's seeded init, and its corpora."""
    plan = tpplan.load(PLAN, [*sets, "mesh.tp=1"])
    model = build_model(plan.model, device="meta", real_buffers=True)
    materialize(model, "cpu")
    init_weights(model, SEED, "cpu")
    vocab = model.config.vocab_size
    return plan, model, load_corpora(plan.data, plan.eval, run_dir, vocab, plan.train.seq_len)


def _documents(tokens: torch.Tensor, corpus) -> dict:
    """The packed chats' positions, restarting after each separator: the trainer masks
    documents from each other by default (data.document_mask)."""
    return {"position_ids": document_positions(tokens, corpus.separator)[:, :-1]}


def test_chat_finetune_2x2_loss_falls_and_eval_is_reported(chat_run):
    run_dir, _, out = chat_run
    m = metrics(run_dir)
    assert sorted(m) == list(range(1, STEPS + 1))
    first, last = (sum(m[s]["loss"] for s in steps) / 3 for steps in ((1, 2, 3), (10, 11, 12)))
    assert last < first - 0.3, (first, last)
    assert [s for s in m if "eval_loss" in m[s]] == [6, 12]
    assert m[12]["eval_ppl"] == pytest.approx(math.exp(m[12]["eval_loss"]))
    assert m[12]["eval_loss"] < m[6]["eval_loss"]
    assert f"val {m[12]['eval_loss']:.4f}" in out and "eval perplexity" in out
    assert "train tokens:" in out and "of them assistant tokens (the loss)" in out


def test_prompt_tokens_carry_no_loss_2x2_equals_one_device(chat_run):
    """Step 1's loss and gradient norm on 2×2 (TP + SP + loss parallel + FSDP2, two
    micro-batches per rank) equal one device's mean cross-entropy over the global batch's
    assistant tokens only -- and not the loss over every token (at a random init the two
    are close, but far apart at this tolerance)."""
    run_dir, sets, _ = chat_run
    model, batch, logits = _same_step_one_device(sets, run_dir)
    assert batch.mask is not None and 0 < batch.count < batch.mask.numel()
    assert metrics(run_dir)[1]["loss_tokens"] == batch.count
    every = summed_loss(logits, batch.tokens, None).item() / batch.tokens[:, 1:].numel()
    assert metrics(run_dir)[1]["loss"] != pytest.approx(every, rel=1e-4)  # no prompt targets


def _same_step_one_device(sets: list[str], run_dir: Path):
    """Step 1 of the run on one device, packed chats masked from each other: its loss and
    gradient norm are the run's. Returns the model, the batch and the logits."""
    _, model, data = _reference(sets, run_dir)
    batch = step_batch(data.train, SEED, 1, 4, 32, 0, 1)
    logits = model(batch.tokens[:, :-1], **_documents(batch.tokens, data.train))
    loss = summed_loss(logits, batch.tokens, batch.mask) / batch.count
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    got = metrics(run_dir)[1]
    assert got["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert got["grad_norm"] == pytest.approx(norm.item(), rel=1e-4)
    return model, batch, logits


def test_eval_loss_2x2_equals_one_device_over_the_same_weights(chat_run):
    """The validation loss at the last step, from the checkpoint's weights on one device:
    the mean over every assistant token of the same held-out windows."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    run_dir, sets, _ = chat_run
    plan, model, data = _reference(sets, run_dir)
    saved = run_dir / "checkpoints" / f"step-{STEPS:06d}"
    dcp_to_torch_save(saved, run_dir / "weights.pt")
    model.load_state_dict(torch.load(run_dir / "weights.pt", weights_only=False)["model"])
    total = count = 0.0
    with torch.no_grad():
        for i in range(4):
            b = eval_batch(data.eval, i, 4, 32, 0, 1)
            logits = model(b.tokens[:, :-1], **_documents(b.tokens, data.eval))
            total += summed_loss(logits, b.tokens, b.mask).item()
            count += b.count
    assert metrics(run_dir)[STEPS]["eval_loss"] == pytest.approx(total / count, rel=1e-5)


def test_resume_on_one_process_reuses_the_token_cache(chat_run, tmp_path):
    run_dir, sets, _ = chat_run
    proc = train([*sets, "mesh.tp=1", f"train.steps={STEPS + 2}"], "--resume", "latest")
    ok(proc)
    assert "reused" in proc.stdout and "made" not in proc.stdout.split("train tokens:")[1][:200]
    assert sorted(metrics(run_dir)) == list(range(1, STEPS + 3))


def test_chat_data_errors_stop_every_rank_before_training(chat_run, tmp_path):
    """A malformed line on 4 ranks: one error line naming the file and line, exit 1."""
    _, sets, _ = chat_run
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}, '
                   '{"role": "assistant", "content": "yo"}]}\n{"messages": [\n')
    out = fails(train([*sets, f"data.path={bad}", f"metrics.run_dir={tmp_path / 'run'}"], nproc=4),
                f"error: {bad}:2: not a JSON object")
    assert out.count("error:") == 1, out


def test_packed_chats_under_pp2_cp2_are_masked_as_on_one_device(tmp_path, tiny_llama):
    """``tpplan train`` on pp 2 × cp 2: every stage gets each token's global position within
    its document (the schedule hands the positions to every stage), so step 1's loss and
    gradient norm equal one device's with the packed chats masked from each other -- and
    not the unmasked loss."""
    d = tmp_path / "pp2-cp2"
    sets = [*chat_sets(tiny_llama, d), "train.steps=1", "eval=null", "mesh.tp=1", "mesh.pp=2",
            "mesh.cp=2", "pipeline={microbatches: 2}", "train.micro_batch_size=null",
            "checkpoint.enabled=false"]
    proc = train(sets, nproc=4)
    ok(proc)
    assert "pp=2 × dp_replicate=1 × dp_shard=1 × cp=2 × tp=1" in proc.stdout
    assert "not masked" not in proc.stdout
    model, batch, _ = _same_step_one_device(sets, d)
    with torch.no_grad():
        unmasked = summed_loss(model(batch.tokens[:, :-1]), batch.tokens, batch.mask) / batch.count
    assert metrics(d)[1]["loss"] != pytest.approx(unmasked.item(), rel=1e-4)  # the mask is real
