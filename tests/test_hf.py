"""Bring your own model: HuggingFace models, plans imported from tp_plan, suggested plans.

Every generated plan is checked where it matters: a real 2x2 gloo mesh, logits and every
gradient against the same HF model on one device.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import TEST_PLANS, tpplan_cli

pytest.importorskip("transformers")

import tpplan  # noqa: E402
from tpplan.analysis.verify.numerics import compare, make_batch, parallel_step, reference_step  # noqa: E402

HF = TEST_PLANS / "hf"


def assert_matches_single_device(plan_path: Path, world: int = 4) -> None:
    plan = tpplan.load(plan_path)
    assert plan.parallel_dims(world).shape == (1, 2, 2)
    tokens = make_batch(vocab_size=256, batch=4, seq_len=16, seed=0)
    result = compare(reference_step(plan, tokens, seed=0),
                     parallel_step(str(plan_path), [], world, tokens, seed=0))
    assert result.ok, "\n".join(f"{what}: {err:.2e}" for what, err in result.failures)


@pytest.mark.parametrize("config,sp", [("llama-config.json", False),
                                       ("qwen2-config.json", True)])
def test_imported_plan_matches_single_device(tmp_path, config, sp):
    out = tmp_path / "plan.yaml"
    args = ["import-hf", HF / config, "-o", out] + (["--sequence-parallel"] if sp else [])
    proc = tpplan_cli(*args)
    assert proc.returncode == 0, proc.stderr
    assert "valid at world size 2" in proc.stderr
    rules = {r.pattern: r.style for r in tpplan.load(out).rules}
    assert rules["model.layers.*.self_attn.{q_proj,k_proj,v_proj}"].name == "colwise"
    assert rules["model.embed_tokens"].name == "rowwise" and rules["lm_head"].name == "colwise"
    assert ("model.layers.*.input_layernorm" in rules) == sp
    assert_matches_single_device(out)


@pytest.mark.parametrize("model_file", ["llama-model.yaml", "opt-model.yaml"])
def test_suggested_plan_matches_single_device(tmp_path, model_file):
    out = tmp_path / "plan.yaml"
    proc = tpplan_cli("suggest", HF / model_file, "-o", out)
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    plan = tpplan.load(out)
    styles = {r.pattern: r.style.name for r in plan.rules}
    if model_file.startswith("opt"):
        assert styles["model.decoder.layers.*.fc1"] == "colwise"
        assert styles["model.decoder.layers.*.fc2"] == "rowwise"
        assert [a.pattern + "." + a.attribute for a in plan.divide_by_tp] == [
            "model.decoder.layers.*.self_attn.num_heads"]
        assert "embed_positions" in text  # said plainly: left replicated
    else:
        assert styles["model.layers.*.mlp.down_proj"] == "rowwise"
        assert "no sequence parallelism" in text and "model.rotary_emb" in text
    assert_matches_single_device(out)


def test_suggest_reproduces_the_reference_llama_plan(root, tmp_path):
    model_only = tmp_path / "model.yaml"
    model_only.write_text("model: {name: llama3, config: debug}\n")
    out = tmp_path / "plan.yaml"
    proc = tpplan_cli("suggest", model_only, "-o", out)
    assert proc.returncode == 0, proc.stderr
    suggested = tpplan.load(out)
    shipped = tpplan.load(root / "plans/llama.yaml")
    assert {r.pattern: r.style.describe() for r in suggested.rules} == \
        {r.pattern: r.style.describe() for r in shipped.rules}
    assert suggested.divide_by_tp == [] or \
        [(a.pattern, a.attribute) for a in suggested.divide_by_tp] == \
        [(a.pattern, a.attribute) for a in shipped.divide_by_tp]
    assert [u.patterns for u in suggested.fsdp.units] == [u.patterns for u in shipped.fsdp.units]


def test_validate_an_hf_plan(tmp_path):
    out = tmp_path / "plan.yaml"
    assert tpplan_cli("import-hf", HF / "llama-config.json", "-o", out).returncode == 0
    proc = tpplan_cli("validate", "--plan", out, "--world-size", "8", "--json")
    data = json.loads(proc.stdout)
    assert data["errors"] == [], data["errors"]  # the plan is valid
    q = next(m for m in data["modules"] if m["path"] == "model.layers.0.self_attn.q_proj")
    assert q["params"][0]["global_shape"] == [64, 64] and q["params"][0]["local_shape"] == [8, 64]
    assert data["memory_per_rank"]["parameters"] > 0
    # ... and its communication is traced too (transformers' mask code is handed a ready
    # mask on the meta device instead of reading tensor values): nothing swallowed.
    assert data["analysis_errors"] == []
    tp = [r for r in data["comm_per_step"]["collectives"] if r["source"] == "tp"]
    assert tp and all(r["count"] > 0 for r in tp)
    assert proc.returncode == 0


def test_missing_extra_is_one_line(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(f"model: {{hf_config: {HF / 'llama-config.json'}}}\n")
    code = ("import sys; sys.modules['transformers'] = None; from tpplan.cli import main; "
            f"sys.exit(main(['validate', '--plan', {str(plan)!r}, '--world-size', '1']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert "pip install 'tpplan[hf]'" in proc.stderr.splitlines()[0]


def test_import_hf_unknown_architecture():
    proc = tpplan_cli("import-hf", "LlamaForCausalLMM")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "did you mean 'LlamaForCausalLM'" in proc.stderr


def test_shipped_hf_llama_plan_passes_verify(root):
    """plans/hf-llama.yaml (made by import-hf) through `tpplan verify`: the HF config is
    shrunk to a tiny one of the same architecture and run on 4 gloo ranks."""
    proc = tpplan_cli("verify", "--plan", "plans/hf-llama.yaml", "--nproc", "4", cwd=root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "grad model.layers.*.self_attn.q_proj.weight" in proc.stdout
    assert "numerics match" in proc.stdout
