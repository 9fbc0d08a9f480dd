"""Fault tolerance on torchft (the plan's ``fault_tolerance`` section, docs/fault-tolerance.md):
2 replica groups × 2 ranks (FSDP 2 inside each) on a real gloo mesh, started by ``tpplan train
--nproc 2`` with its own lighthouse, against a plain ``dp_replicate 2`` HSDP run of the same
plan made here. One rank of group 0 is SIGKILLed by a test hook (tests/hooked.py), then
again while its restart takes the weights from group 1 (a second fault during recovery);
group 1 goes on and writes the checkpoints while group 0 is down, group 0 restarts a second
time, recovers and rejoins. Two launches (the HSDP run and the fault-tolerant one) shared by
the tests below, and one of groups that come back after the run went on without them.

The order of events is made certain by hooks, not left to how fast a loaded machine starts
a process: the survivor waits at chosen steps until the restarted group asks for its quorum.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import PLANS, ROOT, run_main
from hooked import AWAIT, DAMAGE, HOLD, KILL_AT, MARKS
from trainrun import assert_same_curve, metrics, ok, tpplan_train

from tpplan import checkpoint as ckpt

FSDP2 = ["mesh.tp=1"]  # FSDP 2 inside each group: dp_shard takes the 2 ranks
FT = ["fault_tolerance.replica_groups=2", "fault_tolerance.min_replicas=1"]
KILLED = (1, 3)  # global rank 1 (group 0's rank 1) after step 3, before the first checkpoint
FT_STEPS = 20
# group 1 goes on alone past the step-5 checkpoint, then waits after step 6 for group 0's first
# restart to ask for a quorum (it dies taking the weights), after step 12 for its second
WAITS = "6:group0-restart1,12:group0-restart2"


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory) -> Path:
    """The plain HSDP run: dp_replicate 2 × dp_shard 2 on 4 ranks under one torchrun."""
    pytest.importorskip("torchft", reason="the tpplan[ft] extra (torchft) is not installed")
    d = tmp_path_factory.mktemp("ft") / "hsdp"
    ok(tpplan_train(d, nproc=4, sets=[*FSDP2, "mesh.dp_replicate=2"]))
    return d


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> tuple[Path, str]:
    """The fault-tolerant run with group 0's rank 1 killed after step 3 and again in its first
    restart's recovery (the survivor still stepping when each restart is back: it waits for
    it, :data:`WAITS`; every checkpoint kept)."""
    pytest.importorskip("torchft", reason="the tpplan[ft] extra (torchft) is not installed")
    d = tmp_path_factory.mktemp("ft") / "replicated"
    proc = tpplan_train(d, "--max-restarts", "2", nproc=2,
                        sets=[*FSDP2, *FT, f"train.steps={FT_STEPS}", "checkpoint.keep=0"],
                        env={KILL_AT: f"{KILLED[0]}:{KILLED[1]},{KILLED[0]}:recovery",
                             MARKS: str(d.parent / "marks"), AWAIT: WAITS},
                        timeout=300)
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


def test_the_survivor_goes_on_and_the_twice_killed_group_rejoins_bit_identical(killed):
    run_dir, out = killed
    rows = _rows(run_dir / "replica-1")  # the survivor: group 1
    assert [r["step"] for r in rows] == list(range(1, FT_STEPS + 1)), "group 1's steps: no gap, no repeat"
    starts = [line for line in out.splitlines() if line.startswith("tpplan train: ") and " cpu ranks | " in line]
    assert len(starts) == 2 + 2, "each group started once, and group 0 twice more: group 1 never stopped"
    fault = next(r for r in rows if r.get("event") == "fault")
    assert fault["step"] == KILLED[1] + 1 and fault["replicas"] == 1
    assert fault["tokens_trained"] == rows[0]["tokens_trained"] // 2  # group 1's half of the batch
    rejoin = next(r for r in rows if r.get("event") == "rejoin")
    assert rejoin["replicas"] == 2 and [r.get("event") for r in rows].count("fault") == 1, rows
    # the first restart died taking the weights (its try of a step with 2 groups did not
    # commit, so nothing is said of it); the second one recovered and rejoined
    said = out.splitlines()
    assert sum("fault: " in line for line in said) == 1, out[-4000:]
    assert sum("rejoin: " in line for line in said) == 1, out[-4000:]
    assert sum("recovered weights and optimizer state from a live peer" in line for line in said) == 1
    group0 = {r["step"]: r for r in _rows(run_dir)}
    assert min(s for s in group0 if s > KILLED[1]) == rejoin["step"], "group 0 is back at the rejoin"
    recovered = group0[rejoin["step"]]
    assert recovered["event"] == "recovered" and recovered["replicas"] == 2
    # after the recovery the groups hold the same weights, bit for bit, to the last step
    assert recovered["weights_sha256"] == rejoin["weights_sha256"]
    assert group0[FT_STEPS]["weights_sha256"] == rows[-1]["weights_sha256"]
    assert group0[FT_STEPS]["loss"] == rows[-1]["loss"]
    assert "Traceback" not in out


def test_checkpoints_go_on_while_group_0_is_down(killed):
    """Every checkpoint of the plan (interval 5, and the last step) is written, complete, by
    the lowest group of its step: group 1 while group 0 is down."""
    run_dir, _ = killed
    saved = ckpt.complete_checkpoints(run_dir / "checkpoints")
    assert sorted(ckpt.step_of(p) for p in saved) == [5, 10, 15, FT_STEPS]
    assert all(ckpt.is_complete(p) for p in saved)
    group1 = {r["step"]: r for r in _rows(run_dir / "replica-1")}
    assert group1[5]["replicas"] == 1, "step 5 ran without group 0: group 1 wrote its checkpoint"
    assert not (run_dir / "replica-1" / "checkpoints").exists()


def _step_lines(out: str) -> dict[int, list[str]]:
    """Each progress line's loss and gradient norm, by step, in the order printed."""
    said: dict[int, list[str]] = {}
    for line in out.splitlines():
        if line.startswith("step ") and "  loss " in line:
            words = line.split()
            said.setdefault(int(words[1]), []).append(" ".join(words[2:6]))
    return said


def test_groups_back_after_the_run_went_on_take_its_checkpoints_not_their_own_past(tmp_path):
    """Group 0 loses a rank after step 3; its restart (from step 0, or from the step-5
    checkpoint if it is there yet) is held back until the run's last checkpoint exists.
    Group 1 goes on alone, loses a rank after step 12 (its step-10 checkpoint damaged on
    disk just before) and restarts from step 0 with no live group to take the weights from:
    it takes the run's newest intact checkpoint (step 5), not a fresh start, and steps 6..12
    come out as they did before its fault. Group 0, back once group 1 has finished, trains
    nothing and writes nothing."""
    pytest.importorskip("torchft", reason="the tpplan[ft] extra (torchft) is not installed")
    d = tmp_path / "late"
    folder = d / "checkpoints"
    last, tenth = folder / f"step-{FT_STEPS:06d}", folder / "step-000010"
    proc = tpplan_train(d, "--max-restarts", "1", nproc=2,
                        sets=[*FSDP2, *FT, f"train.steps={FT_STEPS}", "checkpoint.keep=0", "metrics.log_interval=1"],
                        env={KILL_AT: f"{KILLED[0]}:{KILLED[1]},3:12", HOLD: f"0:{last}",
                             DAMAGE: f"3:12:{tenth / '__0_0.distcp'}"}, timeout=300)
    ok(proc)
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out[-4000:]
    said = out.splitlines()
    starts = [line for line in said if line.startswith("tpplan train: ") and " cpu ranks | " in line]
    assert len(starts) == 4, "each group started twice"
    # (group 0's restart may say it too, when it looks for a checkpoint to resume after the damage)
    damaged = [line for line in said if line.startswith("replica group 1: checkpoint step-000010 is damaged")]
    assert damaged == [f"replica group 1: checkpoint step-000010 is damaged, not used: {tenth / '__0_0.distcp'}: "
                       "contents do not match the manifest's SHA-256 (corrupted on disk)"], out[-4000:]
    took = [line for line in said if "the run went on to step" in line]
    assert took == [f"replica group 1: the run went on to step 5 without this group, and no group alive "
                    f"holds it; took checkpoint {folder / 'step-000005'} and goes on from step 6"], out[-4000:]
    assert f"replica group 0: the run finished at step {FT_STEPS} while this group was down (checkpoint {last}); " \
        "nothing left to train" in said, out[-4000:]
    # group 1's steps 6..12, before its fault and again from the checkpoint: the same
    steps = _step_lines(out)
    assert all(len(steps[s]) == 2 and steps[s][0] == steps[s][1] for s in range(6, 13)), steps
    group1 = [r["step"] for r in _rows(d / "replica-1") if "loss" in r]
    assert group1 == list(range(1, FT_STEPS + 1)), "its rows past step 5 were dropped at the restart"
    assert [r["step"] for r in _rows(d)] == [1, 2, 3], "group 0 trained nothing once back"
    saved = ckpt.complete_checkpoints(folder)
    assert sorted(ckpt.step_of(p) for p in saved) == [5, 10, 15, FT_STEPS]
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]
    assert all(ckpt.check_contents(p) == [] for p in saved), "step 10 written again, intact"


def test_a_restart_at_the_runs_last_checkpoint_joins_no_quorum(monkeypatch):
    """A group restarted after the others finished starts at the run's last step: it has no
    step to agree on, so no Manager is made (its rank 0 would stop serving it at once, while
    another rank of the group still dials it)."""
    from types import SimpleNamespace

    from tpplan.plan.fault_tolerance import FaultToleranceSpec
    from tpplan.train.replicated import join_replicas

    monkeypatch.setenv("TPPLAN_REPLICA_GROUP", "0")
    prep = SimpleNamespace(plan=SimpleNamespace(spec=SimpleNamespace(fault_tolerance=FaultToleranceSpec()),
                                                train=SimpleNamespace(steps=FT_STEPS)))
    assert join_replicas(prep, None, "cpu", None, FT_STEPS) is None


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


LIGHTHOUSE_GONE = """
import os, sys, types
from pathlib import Path
import torch.distributed as dist
from tpplan.ft.launch import start_lighthouse
from tpplan.ft.replica import Replica
from tpplan.plan.errors import CommandError
from tpplan.plan.fault_tolerance import FaultToleranceSpec

spec = FaultToleranceSpec(timeout_s=0.5)
server, address = start_lighthouse(spec, Path(sys.argv[1]) / "lighthouse.log")
os.environ["TORCHFT_LIGHTHOUSE"] = address
store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
trainee = types.SimpleNamespace(parts=[], optimizers=[], schedules=[], trained=[])
replica = Replica(spec, 0, trainee, "cpu", print)
print("step", replica.next_step(), flush=True)
server.kill()
server.wait()
try:
    replica.next_step()
except CommandError as e:
    print(f"error: {e}", flush=True)
os._exit(0)
"""


def test_a_lost_lighthouse_is_one_line_naming_it(tmp_path):
    """The lighthouse killed between two steps: the next quorum ends, after timeout_s × 4,
    in one line naming the lighthouse and what to do (not torchft's timeout traceback)."""
    pytest.importorskip("torchft", reason="the tpplan[ft] extra (torchft) is not installed")
    proc = subprocess.run([sys.executable, "-c", LIGHTHOUSE_GONE, str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "RUST_LOG": "off", "OMP_NUM_THREADS": "1"})
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == "step 1", proc.stdout + proc.stderr[-3000:]
    [error] = lines[1:]
    assert error.startswith("error: replica group 0: no quorum from the lighthouse http://") and \
        "(no answer in 2 s); start it again (tpplan lighthouse)" in error, error
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_a_lost_peer_is_said_in_gloos_own_words_without_its_boilerplate():
    """What the ranks of a group that lost one say (the README's run shows it): the failed
    collective's words, without gloo's source location and advice."""
    from tpplan.train.failures import peer_cause

    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                        "[127.0.0.1]:36543. This is typically caused by a remote worker crashing. Check the "
                        "logs of the remote worker before reporting an error. GLHF!\nmore")
    assert peer_cause(gloo) == "Connection closed by peer [127.0.0.1]:36543"
    assert peer_cause(RuntimeError("Connection reset by peer")) == "Connection reset by peer"
