"""``tpplan train`` on real gloo CPU processes, against a single-process run of the same plan.

Every reference is computed here, by a run in this test session: a single process with the
same plan, seed and global batch. The parallel runs go through the real CLI (torchrun),
so launching, checks before the process group and exit codes are tested as users see them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hooked import DIE_DURING_SAVE, RECORD_BATCHES
from trainrun import PLAN, STEPS, assert_same_curve, fails, metrics, ok, tpplan_train


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


@pytest.fixture
def reference(reference_run) -> Path:
    return reference_run


@pytest.fixture(scope="module")
def run_2x2(runs) -> Path:
    d = runs / "2x2"
    ok(tpplan_train(d, nproc=4, sets=["mesh.tp=2"], env={RECORD_BATCHES: "1"}))
    return d


def test_2x2_losses_match_single_process(reference, run_2x2):
    ref = metrics(reference)
    assert len(ref) == STEPS and ref[STEPS]["loss"] < ref[1]["loss"]  # it does learn
    assert_same_curve(metrics(run_2x2), ref, range(1, STEPS + 1))


def test_tp_peers_get_identical_batches(run_2x2):
    seen: dict[tuple[int, int], set] = {}
    for f in (run_2x2 / "batches").glob("rank*.jsonl"):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            seen.setdefault((r["step"], r["dp_rank"]), set()).add(r["digest"])
    assert len(seen) == STEPS * 2
    for (_step, dp_rank), digests in seen.items():
        assert len(digests) == 1, f"tp peers of dp rank {dp_rank} saw different batches"
    for step in range(1, STEPS + 1):  # while the two data-parallel ranks see different data
        assert seen[(step, 0)] != seen[(step, 1)]


def _load_dcp(path: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = path.parent / f"{path.name}.pt"
    dcp_to_torch_save(path, out)
    return torch.load(out, weights_only=False)["model"]


def test_2x2_weights_equal_single_process(reference, run_2x2):
    """Same init and same updates, parameter for parameter, read back from the checkpoints."""
    ref = _load_dcp(reference / "checkpoints" / f"step-{STEPS:06d}")
    got = _load_dcp(run_2x2 / "checkpoints" / f"step-{STEPS:06d}")
    assert ref.keys() == got.keys()
    for name, w in ref.items():
        torch.testing.assert_close(got[name], w, rtol=1e-4, atol=1e-5, msg=name)


@pytest.fixture(scope="module")
def killed_1x4(runs) -> tuple[Path, dict[int, dict]]:
    """A 1×4 run killed inside its final (step-12) save; its curve as logged before dying."""
    d = runs / "1x4"
    killed = tpplan_train(d, nproc=4, sets=["mesh.tp=4", "checkpoint.interval=3"],
                          env={DIE_DURING_SAVE: str(STEPS)})
    assert killed.returncode != 0
    return d, metrics(d)


def test_1x4_losses_match_single_process(reference, killed_1x4):
    _, logged = killed_1x4
    assert_same_curve(logged, metrics(reference), range(1, STEPS + 1))


def test_killed_during_save_resumes_from_previous_checkpoint_on_4x1(reference, killed_1x4):
    """The half-written step-12 save is ignored; resume takes step 9, and on a 4×1 mesh
    (saved on 1×4: every parameter resharded) continues the single-process curve."""
    d, _ = killed_1x4
    ckpts = d / "checkpoints"
    assert (ckpts / f"step-{STEPS:06d}.tmp").is_dir()
    assert not (ckpts / f"step-{STEPS:06d}").exists()
    resumed = tpplan_train(d, "--resume", nproc=4, sets=["mesh.tp=1", "checkpoint.interval=3"])
    ok(resumed)
    assert "resumed from" in resumed.stdout and "step-000009" in resumed.stdout
    # metrics.dry_run: false (tests/trainrun.py): nothing predicted, the record says so
    assert json.loads((d / "estimate.json").read_text())["dry_run"] is None
    got = metrics(d)
    assert sorted(got) == list(range(1, STEPS + 1))  # rows past step 9 replaced, not doubled
    assert_same_curve(got, metrics(reference), range(10, STEPS + 1))
    assert (ckpts / f"step-{STEPS:06d}").is_dir()
    assert not (ckpts / f"step-{STEPS:06d}.tmp").exists()


def test_stop_and_resume_same_mesh(reference, runs):
    """Stopped (killed in the final save), resumed from step 10: the same losses."""
    d = runs / "single-resumed"
    stopped = tpplan_train(d, sets=["mesh.tp=1"],
                           env={DIE_DURING_SAVE: str(STEPS)})
    assert stopped.returncode != 0
    resumed = tpplan_train(d, "--resume", sets=["mesh.tp=1"])
    ok(resumed)
    assert "resumed from" in resumed.stdout and "step-000010" in resumed.stdout
    assert_same_curve(metrics(d), metrics(reference), range(1, STEPS + 1), rel=1e-6)


# Checks before the process group read WORLD_SIZE from torchrun's environment; setting it
# directly tests them in one cheap process (the torchrun case below shows all ranks exit).
AS_RANK0_OF_4 = {"WORLD_SIZE": "4", "LOCAL_RANK": "0"}


def test_missing_data_path(runs):
    fails(tpplan_train(runs / "bad", sets=["data.path=/no/such/corpus"]),
           "--set data.path=/no/such/corpus:1:11: error: data.path '/no/such/corpus' does not exist")


def test_unknown_keys_are_located_with_suggestion(runs, tmp_path):
    plan = tmp_path / "typo.yaml"
    plan.write_text(f"extends: {PLAN}\ntrain:\n  stepz: 3\ncheckpoint: {{intervl: 2}}\n")
    fails(tpplan_train(runs / "bad", plan=str(plan), sets=["metrics.log_every=1"]),
           f"{plan}:3:3: error: unknown key 'stepz' in 'train' (did you mean 'steps'?)",
           f"{plan}:4:14: error: unknown key 'intervl' in 'checkpoint' (did you mean 'interval'?)",
           "error: unknown key 'log_every' in 'metrics'")


def test_seq_len_not_divisible_by_tp_under_sp(runs):
    fails(tpplan_train(runs / "bad", sets=["train.seq_len=33"], env=AS_RANK0_OF_4),
           "train.seq_len=33 is not divisible by tp=2")


def test_batch_not_divisible_by_dp(runs):
    fails(tpplan_train(runs / "bad", sets=["mesh.tp=1", "train.global_batch_size=6"],
                        env=AS_RANK0_OF_4),
           "global_batch_size=6 is not divisible by the data-parallel size 4")


def test_world_size_mesh_does_not_fit_exits_on_all_ranks(runs):
    proc = tpplan_train(runs / "bad", nproc=3, sets=["mesh.tp=2"], timeout=120)
    out = fails(proc, "does not fit world size 3")
    assert out.count("does not fit world size 3") == 1  # said once, by rank 0


def test_checkpoint_from_a_different_model(reference, runs):
    fails(tpplan_train(runs / "bad", "--resume", str(reference),
                        sets=["mesh.tp=1", "model.kwargs.n_layers=1"]),
           "is from a different model")
