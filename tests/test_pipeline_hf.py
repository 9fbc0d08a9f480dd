"""HuggingFace decoder models as pipeline stages (tpplan/models/hf_stages.py): the split on a
meta model, each stage's forward against the whole model's in one process, the families
refused with their reason, and pp 2 × tp 2 on 4 gloo processes against one device."""

from __future__ import annotations

import json
import sys

import pytest
from helpers import ROOT, TEST_PLANS, run_main

pytest.importorskip("transformers")
sys.path.insert(0, str(ROOT / "scripts"))

import sweep_hf  # noqa: E402
import sweep_hf_stages  # noqa: E402

import tpplan  # noqa: E402
from tpplan.analysis.verify.numerics import compare, make_batch, parallel_steps, reference_step  # noqa: E402
from tpplan.models import build_model  # noqa: E402
from tpplan.parallel.pipeline.split import split_stages, stage_module  # noqa: E402

PP_PLAN = TEST_PLANS / "hf" / "llama-pp.yaml"


def test_hf_llama_splits_under_the_whole_models_names():
    plan = tpplan.load(str(PP_PLAN), ["model.config.num_hidden_layers=4"])
    model = build_model(plan.model, device="meta")
    split = split_stages(model, plan.spec)
    assert not split.errors and split.blocks_path == "model.layers"
    assert split.first == ("model.embed_tokens",) and split.last == ("model.norm", "lm_head")
    assert [s.blocks for s in split.stages] == [("model.layers.0", "model.layers.1"),
                                                ("model.layers.2", "model.layers.3")]
    first, last = (stage_module(model, s, split) for s in split.stages)
    names = {n for n, _ in first.named_parameters()}
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert {n for n, _ in last.named_parameters()} >= {"model.norm.weight", "lm_head.weight",
                                                      "model.layers.3.mlp.up_proj.weight"}
    assert first.model.rotary_emb is not None and last.model.rotary_emb is not None
    assert first.lm_head is None and last.model.embed_tokens is None
    assert isinstance(first, type(model)) and type(first) is not type(model)


# llama; q/k norms (qwen3); sliding and full layers with their own rotary tables and logit
# soft-capping (gemma3_text); embedding and logit multipliers (granite); a parameter-free
# final norm (olmo); dense then MoE blocks (deepseek_v3)
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text", "granite", "olmo",
                                    "deepseek_v3"])
def test_stages_one_after_another_compute_the_whole_model(tmp_path, family):
    status, worst = sweep_hf_stages.check(family, tmp_path)
    assert status == "ok", (status, worst)


@pytest.mark.parametrize("family, why", [
    ("opt", "OPTModel"),  # decoder.layers, learned positions: not the layout
    ("qwen3_next", "attention types ['linear_attention']"),
    ("doge", "model type 'doge' has the decoder layout, but its forward has not been checked"),
])
def test_families_the_wrapper_cannot_hold_are_refused_at_the_pipeline_section(
        write_plan, tmp_path, family, why):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(sweep_hf.tiny_config(family, num_hidden_layers=2),
                                 default=str))
    path = write_plan(f"model: {{hf_config: {config}}}\nmesh: {{pp: 2, tp: 1}}\n"
                      "pipeline: {schedule: gpipe, microbatches: 2}\n")
    plan = tpplan.load(path)
    [e] = plan.resolve(build_model(plan.model, device="meta"), 2).errors
    assert "cannot be split into pipeline stages" in e.message and why in e.message
    assert e.loc.line == 3


def test_hf_llama_pp2_tp2_verify_and_dry_run(capsys):
    """tpplan verify: HF Llama with transformers' TP plan, pp 2 × tp 2, 1f1b, on 4 gloo
    processes: logits, loss and every gradient against the model on one device; and the
    dry run sizes each stage."""
    rc, out = run_main(capsys, "verify", "--plan", PP_PLAN, "--nproc", "4")
    assert rc == 0, out
    assert "numerics match" in out and "pp=2" in out
    assert "grad model.embed_tokens.weight" in out and "grad lm_head.weight" in out
    rc, out = run_main(capsys, "validate", "--plan", PP_PLAN, "--world-size", "4")
    assert rc == 0, out
    assert "memory per rank by pipeline stage" in out and "first: pp rank 0" in out
    assert "last: pp rank 1" in out


def test_qwen3_with_sequence_parallel_pp2_tp2_matches_one_device(tmp_path):
    """Qwen3's per-head q/k norms and import-hf's sequence parallelism inside each block,
    split over 2 stages, 1f1b and gpipe in one spawn."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(sweep_hf.tiny_config("qwen3", num_hidden_layers=4),
                                 default=str))
    plan_path = tmp_path / "plan.yaml"
    from tpplan.cli import main

    assert main(["import-hf", str(config), "--sequence-parallel", "-o", str(plan_path)]) == 0
    mesh = ["mesh.pp=2", "mesh.tp=2", "mesh.dp_shard=1", "pipeline.microbatches=2"]
    jobs = [[*mesh, f"pipeline.schedule={s}"] for s in ("1f1b", "gpipe")]
    plan = tpplan.load(str(plan_path), jobs[0])
    tokens = make_batch(vocab_size=plan_vocab(plan), batch=4, seq_len=16, seed=0)
    ref = reference_step(plan, tokens, seed=0)
    for par in parallel_steps([(str(plan_path), o, tokens, 0) for o in jobs], 4):
        assert not isinstance(par, str), par
        result = compare(ref, par, tolerance=1e-4)
        assert len(result.rows) == 2 + len(ref.grads)
        assert result.ok, "\n".join(f"{what}: {err:.2e}" for what, err in result.failures)


def plan_vocab(plan) -> int:
    from tpplan.models.introspect import vocab_size

    return vocab_size(build_model(plan.model, device="meta"))
