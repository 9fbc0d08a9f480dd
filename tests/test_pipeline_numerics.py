"""Pipeline stages compute what one device computes: loss, logits and every gradient, on a
real gloo CPU mesh, against the same model, seed and global batch with no plan at all.

Several schedules share one spawn (``parallel_steps``) to keep the processes' start-up paid once.
"""

from __future__ import annotations

import pytest

import tpplan
from tpplan.analysis.verify.numerics import compare, make_batch, parallel_steps, reference_step
from tpplan.cli import main

PLAN = "plans/llama-3d.yaml"
TINY = ["model.kwargs.n_layers=4", "model.kwargs.dim=64"]


def _check(ref, par) -> None:
    result = compare(ref, par, tolerance=1e-4)
    assert len(result.rows) == 2 + len(ref.grads)  # logits, loss, and every gradient
    assert result.ok, "\n".join(f"{what}: {err:.2e}" for what, err in result.failures)


@pytest.mark.parametrize("world, mesh, schedules", [
    (4, ["mesh.pp=2", "mesh.tp=2"], ["1f1b", "gpipe", "interleaved_1f1b"]),
    (8, ["mesh.pp=2", "mesh.dp_shard=2", "mesh.tp=2"], ["1f1b", "gpipe", "interleaved_1f1b"]),
], ids=["pp2-tp2", "pp2-dp2-tp2"])
def test_pipeline_matches_single_device(root, monkeypatch, world, mesh, schedules):
    monkeypatch.chdir(root)
    configs = [[*TINY, *mesh, f"pipeline.schedule={s}"] for s in schedules]
    plan = tpplan.load(PLAN, configs[0])
    assert plan.parallel_dims(world).pp == 2
    tokens = make_batch(vocab_size=256, batch=8, seq_len=16, seed=0)
    ref = reference_step(plan, tokens, seed=0)  # the schedule does not change the model
    for par in parallel_steps([(PLAN, c, tokens, 0) for c in configs], world):
        assert not isinstance(par, str), par  # a job's failure is its error line
        _check(ref, par)


def test_verify_runs_the_pipeline(root, capsys):
    code = main(["verify", "--plan", str(root / PLAN), "--nproc", "4",
                 "--set", "pipeline.schedule=interleaved_1f1b"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "numerics match" in out and "pp=2" in out
    assert "grad tok_embeddings.weight" in out and "grad output.weight" in out  # both ends
