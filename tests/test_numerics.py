"""The promise of a plan: the parallel model computes what the single-device model does.

Each test runs the plan on real gloo processes (``plan.apply`` on a real CPU mesh) and
compares logits, loss and every parameter's gradient with the same model, seed and global
batch on one device, which involves no tpplan code at all.
"""

import pytest

import tpplan
from tpplan.analysis.verify.numerics import compare, make_batch, parallel_steps, reference_step

CASES = [
    # plan, overrides, world size, mesh it must resolve to (dp_replicate, dp_shard, tp)
    ("plans/llama.yaml", [], 4, (1, 2, 2)),  # TP + SP + loss parallel + FSDP2 on 2x2
    ("plans/llama-tp.yaml", [], 4, (1, 1, 4)),  # TP without SP on 1x4
    ("plans/llama-hsdp-tp.yaml", [], 8, (2, 2, 2)),  # HSDP x TP, 3-D
    ("plans/llama-fsdp.yaml", [], 2, (1, 2, 1)),  # FSDP2 only
    ("tests/plans/minigpt.yaml", [], 4, (1, 2, 2)),  # a user's own model through a factory
    # recomputation in backward under TP + SP + FSDP2 changes nothing
    ("plans/llama.yaml", ["activation_checkpointing={mode: selective, every: 2}"], 4, (1, 2, 2)),
]


@pytest.mark.parametrize("world", sorted({c[2] for c in CASES}))
def test_parallel_matches_single_device(root, monkeypatch, world):
    """Every case of this world size in one spawn of gloo processes (start-up paid once)."""
    monkeypatch.chdir(root)
    cases = [c for c in CASES if c[2] == world]
    tokens = make_batch(vocab_size=256, batch=8, seq_len=32, seed=0)
    jobs = [(plan_path, overrides, tokens, 0) for plan_path, overrides, _, _ in cases]
    for (plan_path, overrides, _, shape), par in zip(cases, parallel_steps(jobs, world)):
        what = " ".join([plan_path, *overrides])
        plan = tpplan.load(plan_path, overrides)
        assert plan.parallel_dims(world).shape == shape, what
        assert not isinstance(par, str), f"{what}: {par}"  # a job's failure is its error line
        ref = reference_step(plan, tokens, seed=0)
        result = compare(ref, par, tolerance=1e-4)
        assert len(result.rows) == 2 + len(ref.grads), what  # logits, loss, every gradient
        assert result.ok, what + "\n" + "\n".join(f"{w}: {e:.2e}" for w, e in result.failures)


def test_comparison_catches_a_wrong_gradient(root, monkeypatch):
    """The comparison itself can fail: a perturbed gradient is reported by name."""
    monkeypatch.chdir(root)
    plan = tpplan.load("plans/llama.yaml")
    tokens = make_batch(vocab_size=256, batch=2, seq_len=8, seed=0)
    ref = reference_step(plan, tokens, seed=0)
    other = reference_step(plan, tokens, seed=0)
    other.grads["layers.0.attention.wq.weight"] = other.grads["layers.0.attention.wq.weight"] * 1.01
    result = compare(ref, other, tolerance=1e-4)
    assert [w for w, _ in result.failures] == ["grad layers.0.attention.wq.weight"]
