"""User models through the trainer and verify: bias-free linears initialize, train and
resume; a worker that fails inside ``verify`` is one line naming the rank."""

from __future__ import annotations

import pytest
from helpers import TEST_PLANS, tpplan_cli
from trainrun import QUICK_START

import tpplan
from tpplan.models import build_model
from tpplan.models.init import init_weights, materialize

MINIGPT = TEST_PLANS / "minigpt.yaml"
# the factory's module (tests/toy_models.py) importable in the spawned ranks too
TOYS = {"PYTHONPATH": f"{TEST_PLANS.parent.parent}:{TEST_PLANS.parent}"}


def test_the_initializer_keeps_bias_free_linears_and_is_reproducible():
    plan = tpplan.load(MINIGPT)
    firsts = []
    for _ in range(2):
        model = build_model(plan.model, device="meta")
        assert model.lm_head.bias is None  # registered as None: reset_parameters reads it
        materialize(model, "cpu")
        assert init_weights(model, seed=3, device="cpu") == "reset_parameters"
        firsts.append({n: p.detach().clone() for n, p in model.named_parameters()})
    assert firsts[0].keys() == firsts[1].keys()
    assert all((firsts[0][n] == firsts[1][n]).all() for n in firsts[0])


@pytest.mark.parametrize("plan", [
    MINIGPT,
    # attention on DTensors (SDPA sharded over heads, on a CPU mesh), tied head, SP
    TEST_PLANS / "dtensor-attention.yaml"], ids=lambda p: p.stem)
def test_train_a_user_model_on_two_ranks_and_resume(plan, tmp_path):
    """Bias-free linears (registered as None) initialize; the trainer runs and resumes."""
    run = tmp_path / "run"
    sets = ["train.steps=4", "train.seq_len=16", "train.global_batch_size=2",
            "train.micro_batch_size=1", "checkpoint.interval=2", "data.max_bytes=100000",
            f"metrics.run_dir={run}", *QUICK_START]
    args = ["train", "--plan", plan, "--nproc", "2"]
    for s in sets:
        args += ["--set", s]
    tpplan_cli(*args, env=TOYS, check=True)
    more = [a if a != "train.steps=4" else "train.steps=6" for a in args]
    proc = tpplan_cli(*more, "--resume", env=TOYS, check=True)
    assert "Traceback" not in proc.stdout + proc.stderr


def test_a_worker_failing_in_verify_is_one_line(write_plan):
    plan = write_plan(MINIGPT.read_text().replace("toy_models:mini_gpt",
                                                  "toy_models:fails_on_rank_one"))
    proc = tpplan_cli("verify", "--plan", plan, "--nproc", "2", "--set", "mesh.tp=2",
                      env=TOYS)
    assert proc.returncode == 1
    err = [line for line in proc.stderr.splitlines() if line.strip()]
    assert err[-1] == "error: rank 1 failed: RuntimeError: this model fails on rank 1", \
        proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "ProcessRaisedException" not in proc.stderr


TIED = """mesh: {tp: 2, dp_shard: -1}
model: {factory: "toy_models:tied_gpt", kwargs: {d: 64, n_head: 4, n_layer: 2}}
tensor_parallel:
  wte: {style: rowwise, input_layouts: replicate}
  blocks.*.attn: {style: prepare_input, input_layouts: replicate, desired_input_layouts: replicate}
  blocks.*.attn.{q_proj,k_proj,v_proj}: colwise
  blocks.*.attn.c_proj: rowwise
  blocks.*.mlp.c_fc: colwise
  blocks.*.mlp.c_proj: rowwise
  lm_head: {style: colwise, use_local_output: false}
loss_parallel: true
divide_by_tp: [blocks.*.attn.n_head]
fsdp: {units: ["blocks.*", [wte, ln_f, lm_head]]}
"""


def test_tied_embeddings_stay_one_sharded_weight(write_plan, capsys):
    from tpplan.cli import main

    plan = write_plan(TIED)
    assert main(["verify", "--plan", plan, "--nproc", "4"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "grad wte.weight" in out and "lm_head.weight" not in out  # one weight, one gradient


def test_tied_embeddings_sharded_two_ways_or_in_two_units_are_located(write_plan, capsys):
    from tpplan.cli import main

    plan = write_plan(TIED.replace("  lm_head: {style: colwise, use_local_output: false}\n", "")
                      .replace("loss_parallel: true", "loss_parallel: false"))
    assert main(["validate", "--plan", plan, "--world-size", "4"]) == 1
    out = capsys.readouterr().err
    assert "'wte.weight' and 'lm_head.weight' are one tied weight, sharded differently" in out
    plan = write_plan(TIED.replace("[wte, ln_f, lm_head]", "wte, [ln_f, lm_head]"))
    assert main(["validate", "--plan", plan, "--world-size", "4"]) == 1
    assert "one tied weight in two FSDP units" in capsys.readouterr().err
