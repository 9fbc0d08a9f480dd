"""KV heads fewer than tp: ``import-hf`` and ``suggest`` give the key/value projections
``kv_colwise`` (each rank computes the KV head its query heads use, gradients summed over
tp), ``validate`` reports the replicated weights and their all-reduce, and the plans run on
4 gloo processes (tp 4) with the numbers of one device: logits, loss, every gradient, at the
size that used to crash (transformers#48307) and shrunk."""

import json

import pytest
from helpers import run_main

from tpplan.analysis.verify.numerics import compare, parallel_steps, reference_step, verify_step

pytest.importorskip("transformers")


def _config(tmp_path, kv: int, heads: int = 4, family: str = "llama"):
    config = tmp_path / f"{family}{kv}.json"
    config.write_text(json.dumps({"model_type": family, "num_attention_heads": heads,
                                  "head_dim": 16,
                                  "num_key_value_heads": kv, "hidden_size": 16 * heads,
                                  "intermediate_size": 128, "num_hidden_layers": 2,
                                  "vocab_size": 256}))
    return config


def test_kv_heads_fewer_than_tp_are_replicated_and_match_one_device(tmp_path, capsys):
    plans = {}
    # Qwen3 adds per-head k_norm over the replicated KV heads (sequence_parallel on heads).
    for family, kv, how in (("llama", 2, ["import-hf"]),
                            ("llama", 2, ["import-hf", "--sequence-parallel"]),
                            ("llama", 1, ["import-hf"]),
                            ("llama", 2, ["suggest", "--sequence-parallel", "off"]),
                            ("qwen3", 2, ["import-hf", "--sequence-parallel"])):
        plan = tmp_path / f"{family}-{'-'.join(how)}-{kv}.yaml"
        model = tmp_path / "llama-import-hf-2.yaml" if how[0] == "suggest" else \
            _config(tmp_path, kv, family=family)
        rc, out = run_main(capsys, *how, model, "--tp", "4", "-o", plan)
        assert rc == 0, out
        text = plan.read_text()
        assert "self_attn.q_proj\": colwise" in text and "{k_proj,v_proj}\": kv_colwise" in text
        plans[plan] = kv
    plan = next(iter(plans))
    rc, out = run_main(capsys, "validate", "--plan", plan, "--world-size", "4", "--json")
    assert rc == 0, out
    report = json.loads(out[out.index("{"):])
    k = next(m for m in report["modules"] if m["path"] == "model.layers.0.self_attn.k_proj")
    shape = k["params"][0]
    assert shape["local_shape"] == shape["global_shape"] == [32, 64]  # whole on every rank
    why = " ".join(r["reason"] for r in report["comm_minimum"]["reasons"])
    assert "kv_colwise: 4 key/value projections" in why and "32.00 KiB" in why

    # Real size (the plan's own model: 2 KV heads of 16 at tp 4 crashed) and verify's shrunk
    # model, every plan in one spawn of 4 processes.
    steps = [verify_step(str(p), 4, shrink=False) for p in plans] + \
        [verify_step(str(plan), 4)]
    jobs = [(str(p), s.overrides, s.tokens, 0) for p, s in zip([*plans, plan], steps)]
    for (path, _, _, _), step, par in zip(jobs, steps, parallel_steps(jobs, 4)):
        assert not isinstance(par, str), f"{path}: {par}"
        cmp = compare(reference_step(step.plan, step.tokens, 0), par)
        assert cmp.ok, (path, cmp.failures)


def test_kv_heads_that_fit_neither_way_are_refused_with_both_numbers(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    # 3 KV heads at tp 4: tp neither divides 3 nor is a multiple of it
    rc, out = run_main(capsys, "import-hf", _config(tmp_path, 3, heads=12), "--tp", "4",
                       "-o", plan)
    assert rc == 1 and "Traceback" not in out
    assert "projects 3 heads of head_dim 16 (KV heads fewer than tp) and tp=4 does not " \
           "divide 3" in out and "tp=4 is not a multiple of 3 either" in out
    assert "plan.yaml:" in out
    # a hand-written kv_colwise rule there: the same two numbers, located at the rule
    text = plan.read_text().replace('"model.layers.*.self_attn.{q_proj,k_proj,v_proj}": colwise',
                                    '"model.layers.*.self_attn.q_proj": colwise\n'
                                    '  "model.layers.*.self_attn.{k_proj,v_proj}": kv_colwise')
    plan.write_text(text)
    rc, out = run_main(capsys, "validate", "--plan", plan, "--world-size", "4")
    assert rc == 1 and "Traceback" not in out
    assert "projects 3 KV heads and tp=4 neither divides 3 nor is a multiple of it" in out
