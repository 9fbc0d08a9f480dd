"""``freeze``: parameters that stop training, after TP (which re-enables norm gradients).

Held against one device (no gradient where the plan freezes, every other gradient equal),
against a real ``tpplan train`` (frozen weights bit-identical to their initial values,
norms inside a frozen block included, although SequenceParallel sets their
``requires_grad``), and against the dry run's gradient and optimizer memory.
"""

from __future__ import annotations

import json

import torch
import tpplan
from helpers import PLANS, tpplan_cli
from trainrun import TINY, ok, tpplan_train

from tpplan.checkpoint import latest, read_model_state
from tpplan.cli import main
from tpplan.models import build_model, init_weights

SP_PLAN = PLANS / "llama.yaml"  # TP + SP + loss parallel + FSDP2


def freeze_plan(tmp_path, *patterns: str):
    path = tmp_path / "freeze.yaml"
    path.write_text(f"extends: {SP_PLAN}\nfreeze: {json.dumps(list(patterns))}\n")
    return path


def test_gradients_match_one_device_with_frozen_blocks(tmp_path, capsys):
    plan = freeze_plan(tmp_path, "tok_embeddings", "layers.0")
    assert main(["verify", "--plan", str(plan), "--nproc", "4"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    # A gradient on one side only fails the comparison: the frozen have none on either.
    assert "numerics match" in out


def test_frozen_weights_do_not_move_in_a_real_run(tmp_path):
    plan = freeze_plan(tmp_path, "*", "!layers.1", "!output")  # train the last block + head
    run = tmp_path / "run"
    proc = tpplan_train(run, nproc=4, plan=str(plan), sets=["train.steps=2", "checkpoint.interval=2"])
    ok(proc)
    assert "trained (the rest frozen)" in proc.stdout + proc.stderr
    spec = tpplan.load(plan, TINY).model
    start = build_model(spec, device="cpu")
    init_weights(start, seed=tpplan.load(plan, TINY).train.seed, device="cpu")
    after = read_model_state(latest(run / "checkpoints"))
    moved = {n for n, p in start.state_dict().items() if not torch.equal(after[n], p)}
    trained = {n for n in start.state_dict() if n.startswith(("layers.1.", "output."))}
    assert moved == trained  # norms of layer 0 and the final norm included: unchanged


def test_dry_run_counts_no_gradient_or_optimizer_state_for_frozen_parameters(capsys):
    def memory(*sets):
        args = ["validate", "--plan", str(SP_PLAN), "--world-size", "4", "--json"]
        for s in sets:
            args += ["--set", s]
        assert main(args) == 0
        return json.loads(capsys.readouterr().out)["memory_per_rank"]

    full = memory()
    head_only = memory('freeze=["*", "!output"]')
    model = build_model(tpplan.load(SP_PLAN).model, device="meta")
    head_local = model.output.weight.numel() // 4  # tp 2 × dp_shard 2
    # AdamW: two fp32 moments and a 4-byte step count, for the one trained parameter only
    assert head_only["optimizer"] == 2 * 4 * head_local + 4
    assert head_only["gradients"] == 4 * head_local
    assert head_only["parameters"] == full["parameters"]


def test_freeze_mistakes_are_located(tmp_path):
    plan = freeze_plan(tmp_path, "layers.7", "*")
    proc = tpplan_cli("validate", "--plan", plan, "--world-size", "4")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"{plan}:2:" in proc.stderr
    assert "freeze pattern 'layers.7' matches no parameter or module" in proc.stderr
    assert "'freeze' freezes every parameter" in proc.stderr
