"""A vocabulary tp does not divide (GPT-2's 50,257 at tp 4): ``import-hf`` gives the embedding
and the head ``uneven: true``, a plan without it is refused with the sizes and the option
named, the plans match one device on 4 gloo processes (logits, loss, every gradient, with loss
parallelism and under sequence parallelism), and a run saved on tp 4 resumes on tp 2 along
the curve of one process run straight through, its checkpoint and HF export holding the real
shape."""

import json

import pytest
from helpers import run_main
from trainrun import metrics, ok, tpplan_train

from tpplan.analysis.verify.numerics import compare, parallel_steps, reference_step, verify_step

pytest.importorskip("transformers")

VOCAB = 50257


def _config(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "num_attention_heads": 4,
                                  "num_key_value_heads": 4, "hidden_size": 32,
                                  "intermediate_size": 64, "num_hidden_layers": 2,
                                  "vocab_size": VOCAB}))
    return config


def test_a_vocabulary_tp_does_not_divide_is_split_unevenly(tmp_path, capsys):
    plans = []
    for sp in ([], ["--sequence-parallel"]):
        plan = tmp_path / f"plan{len(sp)}.yaml"
        rc, out = run_main(capsys, "import-hf", _config(tmp_path), "--tp", "4", *sp, "-o", plan)
        assert rc == 0, out
        text = plan.read_text()
        assert "model.embed_tokens: {style: rowwise, input_layouts: replicate" in text
        assert text.count("uneven: true}") == 2
        plans.append(plan)

    bad = tmp_path / "bad.yaml"
    bad.write_text(plans[0].read_text().replace(", uneven: true", ""))
    rc, out = run_main(capsys, "validate", "--plan", bad, "--world-size", "4")
    assert rc == 1 and "Traceback" not in out
    assert "bad.yaml:10:3: error: module 'model.embed_tokens' (Embedding), parameter 'weight': " \
           f"dimension 0 of size {VOCAB} is not divisible by tp=4" in out
    assert "add 'uneven: true' to the rule" in out and "12565, 12565, 12565, 12562" in out

    steps = [verify_step(str(p), 4, shrink=False) for p in plans]
    jobs = [(str(p), s.overrides, s.tokens, 0) for p, s in zip(plans, steps)]
    for (path, *_), step, par in zip(jobs, steps, parallel_steps(jobs, 4)):
        assert not isinstance(par, str), f"{path}: {par}"
        cmp = compare(reference_step(step.plan, step.tokens, 0), par)
        assert cmp.ok, (path, cmp.failures)

    # Saved on tp 4, resumed on tp 2: the curve of one process run straight through.
    sets = ["train.steps=3", "checkpoint.interval=2", "data.max_bytes=50000"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    ok(tpplan_train(whole, plan=str(plans[0]), sets=[*sets, "mesh.tp=1"]))
    ok(tpplan_train(parts, nproc=4, plan=str(plans[0]), sets=[*sets, "train.steps=2"]))
    ok(tpplan_train(parts, "--resume", "latest", nproc=2, plan=str(plans[0]),
                    sets=[*sets, "mesh.tp=2"]))
    a, b = metrics(whole), metrics(parts)
    for step in (1, 2, 3):
        assert abs(a[step]["loss"] - b[step]["loss"]) <= 1e-4 * a[step]["loss"], step
    from tpplan.checkpoint import latest, read_model_state

    state = read_model_state(latest(parts / "checkpoints"))
    assert tuple(state["model.embed_tokens.weight"].shape) == (VOCAB, 32)
    assert tuple(state["lm_head.weight"].shape) == (VOCAB, 32)
    from safetensors import safe_open

    rc, out = run_main(capsys, "export", "--format", "hf", "--checkpoint", parts, "-o",
                       tmp_path / "export")
    assert rc == 0, out
    shapes = {k: f.get_slice(k).get_shape() for p in (tmp_path / "export").glob("*.safetensors")
              for f in [safe_open(p, "pt")] for k in f.keys()}
    assert shapes["model.embed_tokens.weight"] == shapes["lm_head.weight"] == [VOCAB, 32]
