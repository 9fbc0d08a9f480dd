"""Every HuggingFace decoder family the issue names gets a verified plan: tiny configurations
built from transformers' config classes (no download), import-hf and suggest, with and
without sequence parallelism, validated and run on 4 gloo processes (tp 2 × dp 2) against
the same model on one device (logits and every gradient). One spawn for all plans
(``scripts/sweep_hf.py`` runs every family the same way)."""

import json
import sys

import pytest
from helpers import ROOT, run_main

pytest.importorskip("transformers")
sys.path.insert(0, str(ROOT / "scripts"))

import sweep_hf  # noqa: E402

# q/k norms per head (qwen3, gemma3_text), fused qkv/gate_up (phi3), a norm over the whole
# projection (olmo2), parallel attention+MLP (cohere), MoE with experts held as parameters
# (mixtral, qwen3_moe: experts_colwise_rowwise), a shared expert (qwen2_moe), dense-then-MoE
# blocks (glm4_moe); phi3 gets packed_colwise; multi-head latent attention (deepseek_v2:
# mla_kv_a_proj, the rotary key's gradient summed over tp); a gated norm on the sequence shard
# and transformers' rules for the dense first block only, beside a DSA indexer (axk2).
FAMILIES = ["qwen3", "gemma3_text", "phi3", "olmo2", "cohere", "mixtral", "qwen3_moe",
            "qwen2_moe", "glm4_moe", "deepseek_v2", "axk2"]


def sweep_matching_one_device(families: list[str], modes: list[str], folder) -> list:
    """``sweep_hf.run`` of every family in every mode: each cell ok and its verify within
    the sweep's tolerance of one device. The cells, for more checks."""
    cells = sweep_hf.run(families, modes, folder, log=lambda s: None)
    bad = [f"{c.family} {c.mode}: {c.status} {c.detail}" for c in cells if c.status != "ok"]
    assert not bad, "\n".join(bad)
    assert all(c.worst is not None and c.worst < sweep_hf.TOLERANCE for c in cells)
    return cells


def test_families_import_suggest_validate_and_verify(tmp_path):
    cells = sweep_matching_one_device(FAMILIES, list(sweep_hf.MODES), tmp_path)
    # validate reports communication for every one of them (no swallowed trace failure)
    assert all(c.comm for c in cells), [(c.family, c.mode, c.notes) for c in cells]
    qwen3 = (tmp_path / "qwen3" / "import.yaml").read_text()
    assert "self_attn.q_norm\": {style: sequence_parallel, sequence_dim: 2" in qwen3
    assert "per-head norm" in qwen3
    # fused projections are sharded part by part, routed experts over their hidden dimension
    for mode in ("import", "suggest"):
        phi3 = (tmp_path / "phi3" / f"{mode}.yaml").read_text()
        assert "qkv_proj\": {style: packed_colwise, parts: [num_attention_heads, " in phi3
        assert "gate_up_proj\": {style: packed_colwise, parts: 2}" in phi3
        assert "output_layouts: replicate" not in phi3  # nothing gathered
        for moe in ("mixtral", "qwen3_moe"):
            assert "mlp.experts\": experts_colwise_rowwise" in \
                (tmp_path / moe / f"{mode}.yaml").read_text()
    for mode in ("import", "import-sp"):
        assert "kv_a_proj_with_mqa\": mla_kv_a_proj" in \
            (tmp_path / "deepseek_v2" / f"{mode}.yaml").read_text()


def test_families_verify_under_context_parallelism(tmp_path):
    """The sweep's cp mode (``--modes import+cp,import+cp-ulysses``): import-hf's plan at
    tp 2 × cp 2 (ring) validated and equal to one device, on Phi-3, whose fused projections
    give its attention a per-module config copy under tp (routed through cp too). Every
    local-attention family, windows shorter than the sequence, Ulysses and packed
    documents: tests/test_cp_local_attention.py."""
    sweep_matching_one_device(["phi3"], ["import+cp"], tmp_path)


def test_a_per_head_norm_left_without_a_rule_is_a_located_error(write_plan, tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(sweep_hf.tiny_config("qwen3")))
    plan = write_plan(f"""mesh: {{tp: 2, dp_shard: -1}}
model: {{hf_config: {config}}}
tensor_parallel:
  "model.layers.*.self_attn.{{q_proj,k_proj,v_proj}}": colwise
  "model.layers.*.self_attn.o_proj": rowwise
fsdp: {{units: ["model.layers.*"]}}
""")
    rc, out = run_main(capsys, "validate", "--plan", plan, "--world-size", "2")
    assert rc == 1 and "Traceback" not in out
    assert "plan.yaml:4:3: error: module 'model.layers.0.self_attn.q_norm'" in out
    assert "partial sum" in out and "sequence_dim: 2" in out


def test_an_attention_with_per_head_parameters_of_its_own_is_refused_where_sharded(tmp_path,
                                                                                   capsys):
    """Beam's attention adds ``gate_bias[heads]`` itself: transformers' plan shards its
    projections colwise, and import-hf splits the bias with the heads (head_params); without
    that option the plan would meet this rank's heads with every head's bias: refused,
    located at the colwise rule."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(sweep_hf.tiny_config("beam")))
    plan = tmp_path / "plan.yaml"
    rc, out = run_main(capsys, "import-hf", str(config), "-o", str(plan))
    assert rc == 0, out
    text = plan.read_text()
    assert ", head_params: [gate_bias]}" in text
    plan.write_text(text.replace(", head_params: [gate_bias]}", "}"))
    rc, out = run_main(capsys, "validate", "--plan", str(plan), "--world-size", "4")
    assert rc == 1 and "Traceback" not in out
    assert "plan.yaml:" in out and "uses parameters of its own (gate_bias)" in out
    assert "add 'head_params: [gate_bias]' to rule 'model.layers.*.self_attn'" in out


@pytest.mark.parametrize("family", ["phi", "gemma4_text", "hrm_text", "deepseek_v4",
                                    "llama4_text", "gemma3n_text"])
def test_communication_is_computed_where_the_module_tracker_once_stopped(capsys, tmp_path,
                                                                          family):
    """These families call one module twice in a forward (phi's residual dropout, for the
    attention and the MLP): CommDebugMode's module tracker popped its parent twice and the
    communication analysis ended in ``IndexError: list index out of range``. Llama 4 (the
    routed experts' output added in place to the shared expert's) and Gemma 3n (AltUp's
    ``predictions += hidden_states``) write into a module's output: the tracker's global full
    backward hook had wrapped it ("Output 0 of BackwardHookFunction is a view and is being
    modified inplace"). Now computed: the TP collectives by module add up to the step's."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(sweep_hf.tiny_config(family), default=str))
    plan = tmp_path / "plan.yaml"
    rc, _ = run_main(capsys, "import-hf", config, "-o", plan)
    assert rc == 0
    rc, out = run_main(capsys, "validate", "--plan", plan, "--world-size", "2", "--json",
                       "--strict")
    data = json.loads(out[out.index("{"):])
    assert rc == 0 and data["analysis_errors"] == [], data["analysis_errors"]
    comm = data["comm_per_step"]
    assert comm["collectives"] and sum(r["count"] for r in comm["tp_by_module"]) == sum(
        r["count"] for r in comm["collectives"] if r["source"] == "tp")
    assert "wire_bytes" in data["comm_minimum"]


@pytest.mark.parametrize("family, operation", [
    ("longcat_flash", "torch.nonzero() raises unimplemented by default, as a correct "
                      "data-independent implementation does not exist (in module "
                      "'model.layers.0.mlp.experts', forward)")])
def test_a_family_the_trace_cannot_run_names_the_operation_and_module(capsys, tmp_path, family,
                                                                       operation):
    """Where the communication trace cannot run, the reason is the one operation that stops
    it and the module it runs in; the plan itself stays valid (exit 0)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(sweep_hf.tiny_config(family), default=str))
    plan = tmp_path / "plan.yaml"
    assert run_main(capsys, "import-hf", config, "-o", plan)[0] == 0
    rc, out = run_main(capsys, "validate", "--plan", plan, "--world-size", "2", "--json")
    data = json.loads(out[out.index("{"):])
    reasons = {e["analysis"]: e["message"] for e in data["analysis_errors"]}
    assert rc == 0 and data["errors"] == [] and operation in reasons["comm_per_step"], reasons
