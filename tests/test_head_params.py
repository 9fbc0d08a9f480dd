"""Parameters an attention module uses itself, one entry per head (attention sinks, Beam's
``gate_bias``): ``head_params`` splits them with the heads of the colwise projections, so
each rank holds its heads' entries and the gradient is exact. Checked on 2 gloo processes
against one device (sinks sharded over the query heads, a per-KV-head parameter replicated
with kv_colwise, identity experts beside experts_colwise_rowwise); a plan that shards the
projections and not the parameter is refused, located; import-hf translates transformers'
``local_params`` with its ``X.sinks: colwise`` entry and suggest finds the parameters."""

import json
import sys

import pytest
from helpers import ROOT, run_main

from tpplan.analysis.verify.numerics import compare, parallel_steps, reference_step, verify_step
from tpplan.api import load
from tpplan.models import build_model

PLAN = """mesh: {tp: 2}
model: {factory: "head_models:sink_lm"}
tensor_parallel:
  embed: {style: rowwise, input_layouts: replicate}
  "blocks.*.attn": {style: local_params, head_params: [sinks, kv_bias]}
  "blocks.*.attn.q_proj": colwise
  "blocks.*.attn.{k_proj,v_proj}": kv_colwise
  "blocks.*.attn.o_proj": rowwise
  "blocks.*.moe": experts_colwise_rowwise
  head: {style: colwise, use_local_output: false}
loss_parallel: true
"""


def _errors(path: str) -> list[str]:
    plan = load(path)
    res = plan.resolve(build_model(plan.spec.model, device="meta"), 2)
    return [f"{e.loc.line}: {e.message}" for e in res.errors]


def test_per_head_parameters_are_split_with_the_heads_and_match_one_device(write_plan):
    path = write_plan(PLAN)
    assert _errors(path) == []
    step = verify_step(path, 2)
    par = parallel_steps([(path, step.overrides, step.tokens, 0)], 2)[0]
    assert not isinstance(par, str), par
    cmp = compare(reference_step(step.plan, step.tokens, 0), par)
    assert cmp.ok, cmp.failures
    checked = [what for what, _ in cmp.rows]  # the split parameters' gradients among them
    assert all(any(name in w for w in checked) for name in ("sinks", "kv_bias", "gate_up_proj"))


def test_projections_sharded_beside_an_unsplit_per_head_parameter_are_refused(write_plan):
    # no head_params: each rank's attention would read every head's sink
    errs = _errors(write_plan(PLAN.replace(
        '  "blocks.*.attn": {style: local_params, head_params: [sinks, kv_bias]}\n', "")))
    assert len(errs) == 1 and errs[0].startswith("5: ")  # at the colwise rule, line 5
    assert "uses parameters of its own (sinks)" in errs[0]
    assert "give 'blocks.0.attn' {style: local_params, head_params: [sinks]}" in errs[0]
    # a name the module does not hold, and head_params with its projections left whole
    errs = _errors(write_plan(PLAN.replace("[sinks, kv_bias]", "[sink, kv_bias]")))
    assert any("has no parameter 'sink' of its own (did you mean 'sinks'?)" in e for e in errs)
    whole = PLAN.replace('  "blocks.*.attn.q_proj": colwise\n', "").replace(
        '  "blocks.*.attn.{k_proj,v_proj}": kv_colwise\n', "").replace(
        '  "blocks.*.attn.o_proj": rowwise\n', "")
    errs = _errors(write_plan(whole))
    assert len(errs) == 1 and errs[0].startswith("5: ")
    assert "no projection directly under it is sharded by heads" in errs[0]


def test_import_and_suggest_give_attention_sinks_their_rule(tmp_path, capsys):
    pytest.importorskip("transformers")
    sys.path.insert(0, str(ROOT / "scripts"))
    import sweep_hf

    config = tmp_path / "config.json"
    config.write_text(json.dumps(sweep_hf.tiny_config("granite_swa"), default=str))
    (tmp_path / "model.yaml").write_text("model: {hf_config: config.json}\n")
    for args in (["import-hf", config], ["import-hf", config, "--sequence-parallel"],
                 ["suggest", tmp_path / "model.yaml", "--sequence-parallel", "blocks"]):
        plan = tmp_path / "plan.yaml"
        rc, out = run_main(capsys, *args, "-o", plan)
        assert rc == 0, out
        text = plan.read_text()
        rule = next(x for x in text.splitlines() if x.startswith('  "model.layers.*.self_attn":'))
        assert "head_params: [sinks]" in rule
        assert "local_params' for" not in text  # not "no exact PyTorch equivalent; left out"
