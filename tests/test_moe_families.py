"""The HF mixture-of-experts families under expert parallelism (docs/moe.md, docs/models.md):
``tpplan import-hf CONFIG --tp 1 --ep 4``, ``--sequence-parallel --ep 2`` and ``--ep 4`` (tp 2,
the MoE blocks on the sequence shard with ep borrowing tp's ranks where every MoE block is
under SP; ep 4 then spans tp 2 × dp_shard 2), validated and run on 4 gloo processes against
one device (logits, loss, every gradient, the routers' and shared experts' included), on tiny
variants other than the ones tests/test_expert_parallel.py runs:
DeepSeek-V3's grouped top-k with two shared experts and a dense first layer, Llama 4 (no
transformers ep plan; every token to every expert), gpt-oss (transposed experts with biases,
two expert counts), OLMoE, Mixtral at 8 experts top-3 and Qwen3-Next with a dense first layer
(blocks unlike the first). One spawn for all of them. Latent attention whose config sets fewer
KV heads than heads, and expert TP inside EP, are located refusals."""

import json
import re
import sys

import pytest
from helpers import ROOT, run_main

pytest.importorskip("transformers")
sys.path.insert(0, str(ROOT / "scripts"))

import sweep_hf  # noqa: E402

FAMILIES = ["mixtral:e8k3", "olmoe", "deepseek_v3:groups", "deepseek_v3:dense1",
            "llama4_text:step2", "gpt_oss", "gpt_oss:e8k4", "qwen3_next:dense2"]


# MoE blocks unlike the first run without SP (gathered): ep stays beside tp, so ep 4 does not
# fit tp 2 × dp_shard 2 there, a located refusal
GATHERED = {"deepseek_v3:dense1", "llama4_text:step2"}


def test_moe_families_under_expert_parallelism_match_one_device(tmp_path):
    cells = sweep_hf.run(FAMILIES, list(sweep_hf.EP_MODES), tmp_path, log=lambda s: None)
    refused = {(c.family, c.mode) for c in cells if c.status == "refused"}
    assert refused == {(f, "import+ep4+sp") for f in GATHERED}, \
        [(c.family, c.mode, c.detail) for c in cells if c.status != "ok"]
    # validate reports communication for every one of them (Llama 4's in-place add too)
    assert all(c.comm for c in cells if c.status == "ok"), \
        [(c.family, c.mode, c.notes) for c in cells]
    for c in cells:
        if c.status == "refused":
            assert "unless the MoE blocks run on the sequence shard" in c.detail, c.detail
        else:
            assert c.status == "ok" and c.worst < sweep_hf.TOLERANCE, (c.family, c.mode, c.detail)
    for family in FAMILIES:
        folder = tmp_path / family.replace(":", "-")
        for mode in ("import-ep", "import-ep-sp"):
            text = (folder / f"{mode}.yaml").read_text()
            assert "experts\": expert_parallel" in text, (family, mode)
            assert "experts\": experts_colwise_rowwise" not in text, (family, mode)
        for mode in ("import-ep-sp", "suggest-ep"):  # the block on the shard, nothing inside
            rules = "\n".join(x for x in (folder / f"{mode}.yaml").read_text().splitlines()
                              if not x.lstrip().startswith("#"))
            on_shard = re.search(r'\.(mlp|feed_forward)"?: sequence_local', rules) is not None
            assert on_shard == (family not in GATHERED), (family, mode)
            assert "shared_expert" not in rules or family in GATHERED, (family, mode)
    assert "mesh: {tp: 1, ep: 4, dp_shard: -1}" in (tmp_path / "olmoe" / "import-ep.yaml").read_text()
    llama4 = (tmp_path / "llama4_text-step2" / "import-ep.yaml").read_text()
    assert "no transformers ep plan" in llama4 and "feed_forward.experts\": expert_parallel" in llama4


@pytest.mark.parametrize("variant, arch", [("deepseek_v3:kv2", "DeepseekV3Attention"),
                                           ("minicpm3:kv1", "MiniCPM3Attention")])
def test_latent_attention_with_fewer_kv_heads_is_refused_located(tmp_path, capsys, variant, arch):
    """transformers repeats latent attention's per-head keys by heads // KV heads and fails in
    SDPA even on one device: refused at the plan's model line, and by import-hf, with the
    reason; never a traceback inside verify."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(sweep_hf.tiny_config(variant)))
    rc, out = run_main(capsys, "import-hf", config, "-o", tmp_path / "x.yaml")
    assert rc == 1 and "Traceback" not in out and f"({arch}) is latent attention" in out, out
    plan = tmp_path / "plan.yaml"
    plan.write_text(f"mesh: {{tp: 2, dp_shard: -1}}\nmodel: {{hf_config: {config}}}\n"
                    "tensor_parallel:\n  lm_head: colwise\n")
    rc, out = run_main(capsys, "verify", "--plan", plan, "--nproc", "4")
    assert rc == 1 and "Traceback" not in out, out
    assert "plan.yaml:2:1: error: " in out and "set num_key_value_heads to 4" in out, out


def test_suggest_proposes_expert_parallelism_with_the_reason(tmp_path, capsys):
    """For a model with experts modules suggest's notes propose ep and say why; --ep writes
    it (the sweep's suggest+ep cells verify such plans); a dense model's --ep is refused."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(sweep_hf.tiny_config("olmoe")))
    model = tmp_path / "model.yaml"
    model.write_text(f"model: {{hf_config: {config}}}\n")
    rc, out = run_main(capsys, "suggest", model, "-o", tmp_path / "s.yaml")
    assert rc == 0, out
    text = (tmp_path / "s.yaml").read_text()
    assert "model.layers.*.mlp.experts hold 4 routed experts" in text
    assert "expert parallelism fits them" in text and "expert_parallel\n" not in text
    rc, out = run_main(capsys, "suggest", model, "--ep", "2", "-o", tmp_path / "ep.yaml")
    text = (tmp_path / "ep.yaml").read_text()
    assert rc == 0 and "mesh: {tp: 2, ep: 2, dp_shard: -1}" in text, out
    assert '"model.layers.*.mlp.experts": expert_parallel' in text
    assert "expert parallelism fits them" not in text  # done, not proposed
    dense = tmp_path / "dense.yaml"
    dense.write_text("model: {name: llama3, config: debug}\n")
    rc, out = run_main(capsys, "suggest", dense, "--ep", "2")
    assert rc == 1 and "no experts module expert_parallel can spread" in out, out


def test_lora_inside_a_block_on_the_sequence_shard_is_refused_located(tmp_path, capsys):
    """DeepSeek-V3's shared experts are nn.Linear layers inside the MoE block that import-hf
    runs on the sequence shard (sequence_local): an adapter there would miss the gradient
    sum over tp, so the target is refused at its line."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(sweep_hf.tiny_config("deepseek_v3:groups")))
    plan = tmp_path / "plan.yaml"
    rc, out = run_main(capsys, "import-hf", config, "--sequence-parallel", "--ep", "2", "-o", plan)
    assert rc == 0 and '"model.layers.*.mlp": sequence_local' in plan.read_text(), out
    lines = len(plan.read_text().splitlines())
    plan.write_text(plan.read_text() + "lora:\n  rank: 2\n"
                    '  targets: ["model.layers.*.mlp.shared_experts.up_proj"]\n')
    rc, out = run_main(capsys, "validate", "--plan", plan, "--world-size", "4")
    assert rc == 1 and "Traceback" not in out, out
    assert f"plan.yaml:{lines + 3}:" in out and "under style 'sequence_local'" in out, out
