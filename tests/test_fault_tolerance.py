"""Fault tolerance on torchft (the plan's ``fault_tolerance`` section, docs/fault-tolerance.md):
2 replica groups × 2 ranks (FSDP 2 inside each) on a real gloo mesh, started by ``tpplan train
--nproc 2`` with its own lighthouse, against a plain ``dp_replicate 2`` HSDP run of the same
plan made here. One rank of group 1 is SIGKILLed by a test hook (tests/hooked.py); group 0
goes on, group 1 is restarted by its torchrun, takes the weights from group 0 and rejoins.
Two launches in all (the HSDP run and the fault-tolerant one), shared by the tests below.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import PLANS, ROOT, run_main
from hooked import KILL_AT, SLOW_STEP
from trainrun import STEPS, assert_same_curve, metrics, ok, tpplan_train

from tpplan import checkpoint as ckpt

FSDP2 = ["mesh.tp=1"]  # FSDP 2 inside each group: dp_shard takes the 2 ranks
FT = ["fault_tolerance.replica_groups=2", "fault_tolerance.min_replicas=1"]
KILLED = (3, 3)  # global rank 3 (group 1's rank 1) after step 3, before the first checkpoint


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory) -> Path:
    """The plain HSDP run: dp_replicate 2 × dp_shard 2 on 4 ranks under one torchrun."""
    pytest.importorskip("torchft", reason="the tpplan[ft] extra (torchft) is not installed")
    d = tmp_path_factory.mktemp("ft") / "hsdp"
    ok(tpplan_train(d, nproc=4, sets=[*FSDP2, "mesh.dp_replicate=2"]))
    return d


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> tuple[Path, str]:
    """The fault-tolerant run with group 1's rank 1 killed after step 3 (every step slowed so
    the survivor is still stepping when the restarted group is back)."""
    pytest.importorskip("torchft", reason="the tpplan[ft] extra (torchft) is not installed")
    d = tmp_path_factory.mktemp("ft") / "replicated"
    proc = tpplan_train(d, "--max-restarts", "1", nproc=2, sets=[*FSDP2, *FT],
                        env={KILL_AT: f"{KILLED[0]}:{KILLED[1]}", SLOW_STEP: "1.5"}, timeout=300)
    ok(proc)
    return d, proc.stdout + proc.stderr


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_without_a_fault_the_groups_train_the_hsdp_curve(hsdp, killed):
    """Before the kill both groups take part, and the losses and gradient norms are the HSDP
    run's step by step (group 1's rows too: the loss is the quorum's, the same in each)."""
    run_dir, _ = killed
    before = range(1, KILLED[1] + 1)
    got = metrics(run_dir)
    assert [got[s]["replicas"] for s in before] == [2] * len(before)
    assert_same_curve(got, metrics(hsdp), before, rel=1e-5)


def test_the_survivor_goes_on_and_the_killed_group_rejoins_bit_identical(killed):
    run_dir, out = killed
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), "group 0's steps: no gap, no repeat"
    assert "resumed from" not in out, "nobody reloads a checkpoint"
    fault = next(r for r in rows if r.get("event") == "fault")
    assert fault["step"] == KILLED[1] + 1 and fault["replicas"] == 1
    assert fault["tokens_trained"] == rows[0]["tokens_trained"] // 2  # group 0's half of the batch
    rejoin = next(r for r in rows if r.get("event") == "rejoin")
    assert rejoin["replicas"] == 2 and rejoin["step"] - fault["step"] <= 7, rejoin
    group1 = {r["step"]: r for r in _rows(run_dir / "replica-1")}
    recovered = next(r for r in group1.values() if r.get("event") == "recovered")
    assert recovered["step"] == rejoin["step"]
    # after the recovery the groups hold the same weights, bit for bit, to the last step
    assert recovered["weights_sha256"] == rejoin["weights_sha256"]
    assert group1[STEPS]["weights_sha256"] == rows[-1]["weights_sha256"]
    assert group1[STEPS]["loss"] == rows[-1]["loss"]
    assert sum("fault: " in line for line in out.splitlines()) == 1, out[-4000:]
    assert sum("rejoin: " in line for line in out.splitlines()) == 1
    assert sum("recovered weights and optimizer state from a live peer" in line
               for line in out.splitlines()) == 1
    saved = ckpt.complete_checkpoints(run_dir / "checkpoints")
    assert saved and ckpt.step_of(saved[0]) == STEPS and all(ckpt.is_complete(p) for p in saved)
    assert "Traceback" not in out


def test_a_plan_with_the_section_without_torchft_is_one_line(tmp_path):
    """torchft hidden from the interpreter: one line naming the extra, exit 1."""
    code = ("import sys; sys.modules['torchft'] = None; from tpplan.cli import main; "
            f"sys.exit(main(['train', '--plan', {str(PLANS / 'llama.yaml')!r}, "
            "'--set', 'fault_tolerance.replica_groups=2', '--set', "
            f"'metrics.run_dir={tmp_path}', '--nproc', '2']))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and "pip install 'tpplan[ft]'" in lines[0], lines


def test_what_does_not_compose_is_refused_at_its_key(capsys, tmp_path):
    plan = tmp_path / "p.yaml"
    plan.write_text(f"extends: {PLANS / 'llama.yaml'}\nmesh: {{tp: 2, dp_shard: -1, dp_replicate: 3, pp: 2}}\n"
                    "fault_tolerance: {replica_groups: 2, min_replicas: 4, lighthouse: host:1}\n")
    rc, out = run_main(capsys, "validate", "--plan", plan, "--world-size", "8")
    assert rc == 1
    assert f"{plan}:2:43: error: 'mesh.dp_replicate' is 3 but fault_tolerance.replica_groups is 2" in out
    assert f"{plan}:2:50: error: fault_tolerance does not compose with mesh.pp=2" in out
    assert f"{plan}:3:52: error: 'fault_tolerance.min_replicas' is 4, more than the 2" in out
    assert f"{plan}:3:67: error: 'fault_tolerance.lighthouse' must be an address like http://host:29510" in out


def test_validate_shows_the_traffic_between_groups_and_the_lighthouse(capsys):
    """The dry run sees the groups as dp_replicate (HSDP's mesh): across groups, one all-reduce
    per step of what HSDP all-reduces over dp_replicate."""
    args = ["validate", "--plan", PLANS / "llama.yaml", "--world-size", "4", "--set", "mesh.tp=1",
            "--set", "fault_tolerance.replica_groups=2"]
    rc, out = run_main(capsys, *args, "--json")
    assert rc == 0, out
    data = json.loads(out)
    hsdp = [r for r in data["comm_per_step"]["collectives"] if r["mesh_dim"] == "dp_replicate"]
    ft = data["fault_tolerance"]
    assert ft["ranks_per_group"] == 2 and ft["collectives"] == 1
    assert ft["cross_group_bytes"] == sum(r["bytes"] for r in hsdp) > 0
    assert ft["lighthouse"] == "started by tpplan train on the launching machine"


def test_report_lists_the_fault_and_the_rejoin(killed, capsys):
    run_dir, _ = killed
    rc, out = run_main(capsys, "report", run_dir)
    assert rc == 0, out
    line = next(x for x in out.splitlines() if x.startswith("replica groups: "))
    assert f"step {KILLED[1] + 1} fault (1 replica groups)" in line and "rejoin (2 replica groups)" in line
