"""Decoder families whose blocks are not all alike or not plain: the plans import-hf and
suggest make for them, and `validate`'s dry run of each (one process: it traces the
parallelized model, so a rule that splits what the next layer reads whole fails there with
the shapes). The numbers of AXK2 (a gated norm, dense-then-MoE blocks, a DSA indexer) are
checked against one device in tests/test_hf_families.py; every family below is verified in
the sweep (docs/models.md)."""

import json
import re
import sys
from pathlib import Path

import pytest
import torch.nn as nn
from helpers import ROOT

pytest.importorskip("transformers")
sys.path.insert(0, str(ROOT / "scripts"))

import sweep_hf  # noqa: E402

from tpplan.byom.gated_norm import is_gated_norm  # noqa: E402
from tpplan.byom.import_rules import grad_allreduce_rule, like_blocks  # noqa: E402


def _plan(tmp_path: Path, family: str, mode: str) -> str:
    """The plan ``mode`` makes for ``family``'s tiny configuration, validated at world size 4
    with every analysis run (communication reported, no analysis failed)."""
    folder = tmp_path / family
    folder.mkdir(exist_ok=True)
    config = folder / "config.json"
    config.write_text(json.dumps(sweep_hf.tiny_config(family), default=str))
    cell = sweep_hf.Cell(family, mode)
    sweep_hf.make_plan(cell, config, folder)
    assert cell.status == "ok", cell.detail
    sweep_hf.validate(cell, 4)
    assert cell.status == "ok" and cell.comm and not cell.notes, (cell.detail, cell.notes)
    return cell.plan.read_text().split("# Not decided")[0]


def test_an_undecided_transformers_rule_covers_the_blocks_the_dataflow_rules_cover(tmp_path):
    """dots3-note: dense layer 0, MoE layer 1. The dataflow's rules cover layer 0; transformers'
    q_b_proj/kv_b_proj rules (which the dataflow leaves undecided) must cover it alone, or
    layer 1 would shard q_b_proj beside a whole o_proj. Its k_rope_only_layernorm (a norm on
    the rotary key every head reads) gets its gradient summed over tp, transformers'
    replicated_with_grad_allreduce; the experts, only in layer 1, keep transformers' pattern."""
    plans = {mode: _plan(tmp_path, "dots3_note_text", mode) for mode in ("import", "import+sp")}
    for plan in plans.values():
        assert '"model.layers.*.self_attn' not in plan
        assert "model.layers.0.self_attn.q_b_proj: colwise" in plan
        assert "model.layers.0.self_attn.k_rope_only_layernorm: {style: sequence_parallel, " \
               "sequence_dim: 0, use_local_output: true}" in plan
    assert '"model.layers.*.mlp.experts": experts_colwise_rowwise' in plans["import"]


def test_like_blocks_and_grad_allreduce_rules():
    hits = {"m.layers.0.attn.q", "m.layers.1.attn.q", "m.layers.1.moe"}.__contains__
    find = lambda p: [p] if hits(p) else []  # noqa: E731
    beside = {"m.layers.0.attn.o"}  # the dataflow's rule for the projection beside q
    assert like_blocks("m.layers.*.attn.q", "m.layers", "0", find, beside) == "m.layers.0.attn.q"
    assert like_blocks("m.layers.*.attn.q", "m.layers", "0", find, set()) == "m.layers.*.attn.q"
    assert like_blocks("m.layers.*.moe", "m.layers", "0", find, beside) == "m.layers.*.moe"
    assert like_blocks("m.layers.*.attn.q", "m.layers", "*", find, beside) == "m.layers.*.attn.q"
    assert grad_allreduce_rule("n", [nn.RMSNorm(4)])[1]["sequence_dim"] == 0
    assert grad_allreduce_rule("n", [nn.RMSNorm(4, elementwise_affine=False)]) is None
    assert grad_allreduce_rule("n", [nn.Linear(4, 4)]) is None


def test_a_packed_projection_transformers_does_not_shard_stays_replicated(tmp_path):
    """Granite 4 hybrid's shared_mlp (input_linear packs gate and up): transformers' plan
    shards only the routed experts, so the packed projection stays whole beside its whole
    output_linear (it used to be packed_colwise before a replicated output_linear)."""
    plan = _plan(tmp_path, "granitemoehybrid", "import")
    assert "shared_mlp" not in plan
    assert '"model.layers.*.block_sparse_moe.experts": experts_colwise_rowwise' in plan


def test_gated_norm_runs_on_the_sequence_shard_leaf_by_leaf(tmp_path):
    """AXK2's input_layernorm is a norm with a small MLP of its own (y * sigmoid(mlp(y))): it
    opens the attention's sub-layer like a norm, whole without sequence parallelism, and on
    the sequence shard with it, each leaf sequence_parallel (SequenceParallel on the gated
    norm itself would re-register 'norm.weight', a name with a dot)."""
    from transformers.models.axk2 import modeling_axk2

    config = modeling_axk2.AXK2Config(**sweep_hf.tiny_config("axk2"))
    assert is_gated_norm(modeling_axk2.AXK2GatedRMSNorm(config))
    assert not is_gated_norm(nn.RMSNorm(4)) and not is_gated_norm(
        nn.Sequential(nn.RMSNorm(4), nn.Conv1d(4, 4, 3)))
    plain = _plan(tmp_path, "axk2", "suggest")
    assert "input_layernorm" not in plain
    sp = _plan(tmp_path, "axk2", "suggest+sp")
    for leaf in ("norm", "mlp.fc1", "mlp.fc2"):
        assert f"model.layers.0.input_layernorm.{leaf}: sequence_parallel" in sp
    assert re.search(r"model.layers.0.self_attn: \{style: prepare_input_output, "
                     r"input_kwarg_layouts: \{hidden_states: shard\(1\)\}", sp)


def test_blocks_returning_several_outputs_get_one_layout_each_under_sp(tmp_path):
    """GLM-MoE-DSA's (and HY-V4's) decoder layer returns (hidden_states, topk_indices): the
    block's sequence-parallel rule names a layout for each (the indices pass as they are)."""
    plan = _plan(tmp_path, "glm_moe_dsa", "suggest+sp")
    assert '"model.layers.*": {style: prepare_input_output, input_layouts: replicate, ' \
           "desired_input_layouts: shard(1), use_local_input: true, output_layouts: " \
           "[shard(1), null], desired_output_layouts: [replicate, null]}" in plan
