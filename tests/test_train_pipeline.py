"""``tpplan train`` with pipeline stages (plans/llama-3d.yaml) on real gloo CPU processes.

The loss curve of ``pp 2 × tp 2`` equals a single-process run of the same plan without a
pipeline (made here, in this session); its checkpoint resumes on other pp, tp and dp degrees
(``pp 1 × tp 2 × dp_shard 2``, ``pp 4 × tp 1``) and continues the same curve.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import PLANS
from hooked import DIE_DURING_SAVE
from trainrun import STEPS, assert_same_curve, fails, metrics, ok, tpplan_train

PLAN = str(PLANS / "llama-3d.yaml")
# 4 blocks, so pp=4 has one each; the micro-batches are the schedule's under a pipeline.
# trainrun's train.global_batch_size=4 replaces the plan's local_batch_size: the resumes on
# other dp degrees see the same batches.
PP = ["model.kwargs.n_layers=4", "train.micro_batch_size=null", "pipeline.microbatches=2"]
NO_PIPELINE = ["mesh.pp=1", "pipeline=null"]
AT = 10  # the checkpoint the resumes start from (checkpoint.interval=5)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pp-runs")


@pytest.fixture(scope="module")
def flat(runs) -> dict[int, dict]:
    """The same plan without a pipeline, one process: the curve to reproduce."""
    d = runs / "flat"
    ok(tpplan_train(d, plan=PLAN, sets=[*PP, *NO_PIPELINE, "mesh.tp=1"]))
    return metrics(d)


@pytest.fixture(scope="module")
def pp2_tp2(runs) -> Path:
    """pp 2 × tp 2, killed inside its final save (stopped): checkpoints at steps 5 and 10."""
    d = runs / "pp2-tp2"
    stopped = tpplan_train(d, nproc=4, plan=PLAN, sets=[*PP, "mesh.pp=2", "mesh.tp=2"],
                           env={DIE_DURING_SAVE: str(STEPS)})
    assert stopped.returncode != 0
    assert (d / "checkpoints" / f"step-{AT:06d}").is_dir()
    return d


def test_pp2_tp2_loss_falls_like_the_run_without_pipeline(flat, pp2_tp2):
    assert flat[STEPS]["loss"] < flat[1]["loss"]  # it does learn
    assert_same_curve(metrics(pp2_tp2), flat, range(1, STEPS + 1))


@pytest.mark.parametrize("name, sets", [
    ("pp1-tp2-dp2", [*NO_PIPELINE, "mesh.tp=2", "mesh.dp_shard=2"]),
    ("pp4-tp1", ["mesh.pp=4", "mesh.tp=1", "pipeline.microbatches=4"]),
])
def test_resume_on_other_pipeline_degrees_continues_the_curve(runs, flat, pp2_tp2, name, sets):
    d = runs / name
    resumed = tpplan_train(d, "--resume", str(pp2_tp2 / "checkpoints" / f"step-{AT:06d}"),
                           nproc=4, plan=PLAN, sets=[*PP, *sets])
    ok(resumed)
    assert f"resumed from {pp2_tp2}" in resumed.stdout
    got = metrics(d)
    assert sorted(got) == list(range(AT + 1, STEPS + 1))
    assert_same_curve(got, flat, range(AT + 1, STEPS + 1))


def test_eval_is_refused_under_pp_before_any_process(runs):
    fails(tpplan_train(runs / "bad", plan=PLAN, sets=[*PP, "eval.fraction=0.1"],
                       env={"WORLD_SIZE": "4", "LOCAL_RANK": "0"}),
          "'eval' section is not supported with pipeline stages yet")
