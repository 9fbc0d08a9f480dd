"""Per-operator selective activation checkpointing (``activation_checkpointing: op``): the
same losses and gradients as no checkpointing on a real gloo mesh (tp 2, DTensor operators
inside the checkpointed blocks), and memory between full checkpointing and none."""

from __future__ import annotations

import pytest

import tpplan
from tpplan.analysis.verify.numerics import compare, make_batch, parallel_steps, reference_step


def test_op_checkpointing_matches_single_device_on_tp2(root, monkeypatch):
    """tp 2 + SP + loss parallel, every block under op SAC, against one device without any
    checkpointing: logits, loss and every gradient."""
    monkeypatch.chdir(root)
    overrides = ["mesh.tp=2", "model.kwargs.n_layers=2", "activation_checkpointing=op"]
    tokens = make_batch(vocab_size=256, batch=2, seq_len=16, seed=0)
    (par,) = parallel_steps([("plans/llama.yaml", overrides, tokens, 0)], 2)
    assert not isinstance(par, str), par
    plan = tpplan.load("plans/llama.yaml", overrides)
    assert plan.activation_checkpointing.mode == "op"
    ref = reference_step(plan, tokens, seed=0)
    result = compare(ref, par, tolerance=1e-4)
    assert result.ok, "\n".join(f"{w}: {e:.2e}" for w, e in result.failures)


def test_dry_run_counts_op_checkpointing_between_full_and_none(capsys):
    """The dry run traces the same wrapped blocks: op SAC's activation memory and peak lie
    between full checkpointing's and none's (tp 2, the debug Llama)."""
    import json

    from helpers import run_main

    mem = {}
    for mode in ("none", "full", "op"):
        rc, out = run_main(capsys, "validate", "--plan", "plans/llama.yaml", "--world-size", "2",
                           "--set", f"activation_checkpointing={mode}", "--json")
        assert rc == 0, out
        mem[mode] = json.loads(out)["memory_per_rank"]
    for key in ("activations", "peak"):
        assert mem["full"][key] < mem["op"][key] < mem["none"][key], (key, mem)


def test_a_wrong_mode_is_located(root, write_plan):
    path = write_plan(f"extends: {root / 'plans/llama.yaml'}\nactivation_checkpointing: {{mode: opp}}\n")
    with pytest.raises(tpplan.PlanErrors) as e:
        tpplan.load(path)
    assert f"{path}:2:" in str(e.value) and "none, full, selective, op" in str(e.value), str(e.value)
