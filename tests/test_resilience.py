"""What clusters do to a run -- workers killed, preemption signals, damaged checkpoints, two
runs in one folder, kills mid-write -- each as the user sees it (exit code, one line, no
traceback) and with nothing lost: the curve after recovery is the single-process reference's
(``reference_run``, made in this session), the metrics rows are exactly the steps run.

Failures are real: a worker SIGKILLed by a test hook (tests/hooked.py), signals sent to the real launcher,
bytes flipped in real checkpoint files. Full disks and read-only folders: tests/test_disks.py.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from hooked import KILL_AT, SLOW_STEP as SLOW
from trainrun import (
    STEPS, assert_same_curve, fails, finish, metrics, ok, start_train, tpplan_train, wait_for_step,
)

from tpplan import checkpoint as ckpt
from tpplan.train.runfolder import LOCK_FILE, RunLock


def steps_logged(run_dir: Path) -> list[int]:
    return sorted(metrics(run_dir))


def test_killed_worker_is_restarted_and_the_run_ends_on_the_uninterrupted_curve(
        reference_run, tmp_path):
    """torchrun --max-restarts 1 (through ``--nproc``): one worker SIGKILLed at a random step
    after the first checkpoint; the group restarts, resumes by itself (no --resume given;
    the first round's --overwrite must not wipe what it saved), and finishes with the
    losses of a run nobody interrupted."""
    rank, step = random.randrange(4), random.randint(6, STEPS - 1)
    d = tmp_path / "restarted"
    proc = tpplan_train(d, "--max-restarts", "1", "--overwrite", nproc=4, sets=["mesh.tp=2"],
                        env={KILL_AT: f"{rank}:{step}"})
    ok(proc)
    out = proc.stdout + proc.stderr
    resumed_at = 10 if step >= 10 + 1 else 5  # the kill comes before that step's save
    assert "restarted by torchrun" in out, (rank, step, out[-3000:])
    assert f"resumed from {d / 'checkpoints'}/step-{resumed_at:06d}" in out, (rank, step)
    assert "Traceback" not in out
    assert steps_logged(d) == list(range(1, STEPS + 1))
    assert_same_curve(metrics(d), metrics(reference_run), range(1, STEPS + 1))


def test_sigterm_stops_every_rank_after_the_step_with_a_checkpoint(reference_run, tmp_path):
    """SIGTERM to the launcher (what SLURM sends) reaches all 4 workers; they finish the step,
    agree, save, and exit 75 with one line; --resume then continues the same curve."""
    d = tmp_path / "preempted"
    sets = ["mesh.tp=2", "checkpoint.interval=0"]  # the signal's save is the only one mid-run
    proc = start_train(d, nproc=4, sets=sets, env={SLOW: "0.3"})
    wait_for_step(d, 3, proc)
    proc.send_signal(signal.SIGTERM)
    out = finish(proc)
    assert proc.returncode == 75, out[-3000:]
    lines = [line for line in out.splitlines() if "stopped by SIGTERM" in line]
    assert len(lines) == 1, out[-3000:]
    n = int(re.search(r"after step (\d+)", lines[0]).group(1))
    saved = d / "checkpoints" / f"step-{n:06d}"
    assert f"checkpoint saved at {saved}; continue with --resume" in lines[0]
    assert "Traceback" not in out
    assert ckpt.is_complete(saved) and not list(saved.parent.glob("*.tmp"))
    assert steps_logged(d) == list(range(1, n + 1))
    resumed = tpplan_train(d, "--resume", nproc=4, sets=sets)
    ok(resumed)
    assert f"resumed from {saved} at step {n}" in resumed.stdout
    assert_same_curve(metrics(d), metrics(reference_run), range(1, STEPS + 1))


def test_a_second_signal_aborts_at_once_without_a_checkpoint(tmp_path):
    d = tmp_path / "aborted"
    proc = start_train(d, sets=["mesh.tp=1"], env={SLOW: "8"})  # step 1 then an 8 s pause
    wait_for_step(d, 1, proc)
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=2.5)  # the first one waits for the step to end
    except subprocess.TimeoutExpired:
        pass
    assert proc.returncode is None
    proc.send_signal(signal.SIGINT)
    out = finish(proc, timeout=5)  # at once: well before the step's pause is over
    assert proc.returncode == 130, out[-2000:]
    assert "second SIGINT: aborting now, without a checkpoint" in out
    assert "Traceback" not in out
    assert not (d / "checkpoints").exists() or not any((d / "checkpoints").iterdir())


# --- damaged checkpoints ------------------------------------------------------------------

def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 4] = bytes(b ^ 0xFF for b in data[mid:mid + 4])
    path.write_bytes(bytes(data))


def _garble_same_size(path: Path) -> None:
    path.write_bytes(b"\x07" * path.stat().st_size)


DAMAGE = {  # what a user finds on disk -> (how to make it, what the run must say)
    "truncated shard": (lambda c: os.truncate(c / "__0_0.distcp", 1000),
                        "__0_0.distcp: is 1,000 bytes, the manifest says"),
    "flipped bytes": (lambda c: _flip(c / "__0_0.distcp"),
                      "__0_0.distcp: contents do not match the manifest's SHA-256"),
    "missing shard": (lambda c: (c / "__0_0.distcp").unlink(), "__0_0.distcp: is missing"),
    "empty trainer state": (lambda c: (c / "trainer.json").write_text(""),
                            "trainer.json: is 0 bytes, the manifest says"),
    "garbage trainer state": (lambda c: _garble_same_size(c / "trainer.json"),
                              "trainer.json: is not valid JSON"),
    "garbage manifest": (lambda c: (c / "manifest.json").write_text("{nope"),
                         "manifest.json: is not a valid manifest"),
}


def _copy_run(reference_run: Path, dest: Path) -> Path:
    shutil.copytree(reference_run, dest)
    return dest


@pytest.mark.parametrize("case", list(DAMAGE))
def test_resume_names_the_damaged_file_and_falls_back(reference_run, tmp_path, case):
    d = _copy_run(reference_run, tmp_path / "run")
    newest = d / "checkpoints" / f"step-{STEPS:06d}"
    damage, said = DAMAGE[case]
    damage(newest)
    proc = tpplan_train(d, "--resume", sets=["mesh.tp=1"])
    ok(proc)
    out = proc.stdout + proc.stderr
    assert f"checkpoint step-{STEPS:06d} is damaged, not used: {newest}/" in out
    assert said in out, out[-2000:]
    assert f"falling back to {d / 'checkpoints' / 'step-000010'}" in out
    assert "Traceback" not in out
    assert steps_logged(d) == list(range(1, STEPS + 1))
    assert_same_curve(metrics(d), metrics(reference_run), range(1, STEPS + 1), rel=1e-6)


def test_no_intact_checkpoint_left_is_one_line(reference_run, tmp_path):
    d = _copy_run(reference_run, tmp_path / "run")
    for c in ckpt.complete_checkpoints(d / "checkpoints"):
        _flip(c / "__0_0.distcp")
    rows = (d / "metrics.jsonl").read_text()
    fails(tpplan_train(d, "--resume", sets=["mesh.tp=1"]),
          "error: cannot resume: none of the 2 complete checkpoints in "
          f"{d / 'checkpoints'} is intact (newest: {d / 'checkpoints'}/step-{STEPS:06d}/"
          "__0_0.distcp: contents do not match")
    assert (d / "metrics.jsonl").read_text() == rows  # nothing touched


def test_a_named_damaged_checkpoint_is_refused_not_replaced(reference_run, tmp_path):
    d = _copy_run(reference_run, tmp_path / "run")
    named = d / "checkpoints" / "step-000010"
    os.truncate(named / "__0_0.distcp", 10)
    fails(tpplan_train(d, "--resume", str(named), sets=["mesh.tp=1"]),
          f"error: cannot resume: {named}/__0_0.distcp: is 10 bytes")


class _RunsCode:
    """Unpickling this creates a file: proof that a checkpoint ran code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_crafted_legacy_trainer_state_cannot_run_code(reference_run, tmp_path):
    """An older checkpoint layout (pickled ``trainer.pt``, no manifest) is read with
    ``weights_only=True``: a crafted pickle is refused, never executed."""
    d = _copy_run(reference_run, tmp_path / "run")
    newest = d / "checkpoints" / f"step-{STEPS:06d}"
    (newest / "trainer.json").unlink()
    (newest / "manifest.json").unlink()
    marker = tmp_path / "code-ran"
    with open(newest / "trainer.pt", "wb") as f:
        pickle.dump({"step": STEPS, "payload": _RunsCode(marker)}, f)
    proc = tpplan_train(d, "--resume", sets=["mesh.tp=1"])
    ok(proc)
    out = proc.stdout + proc.stderr
    assert f"{newest}/trainer.pt: cannot be loaded safely" in out
    assert "falling back to" in out
    assert not marker.exists()


# --- the run folder -------------------------------------------------------------------------

def test_a_second_run_in_the_same_folder_is_refused_and_the_first_loses_nothing(tmp_path):
    d = tmp_path / "busy"
    steps = 30  # 14 s still to go at step 2: the second run starts well inside it, even on a busy machine
    first = start_train(d, sets=["mesh.tp=1", f"train.steps={steps}"], env={SLOW: "0.5"})
    wait_for_step(d, 2, first)
    second = tpplan_train(d, "--overwrite", sets=["mesh.tp=1", f"train.steps={steps}"])
    fails(second, f"error: {d} is in use by another run: process {first.pid} on "
                  f"{socket.gethostname()}", "is still running")
    out = finish(first)
    assert first.returncode == 0, out[-2000:]
    assert steps_logged(d) == list(range(1, steps + 1))  # one curve, not interleaved
    assert not (d / LOCK_FILE).exists()  # released on exit


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _write_lock(run_dir: Path, host: str, pid: int, launch: str | None = None) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / LOCK_FILE).write_text(json.dumps(
        {"host": host, "pid": pid, "start": None, "launch": launch, "since": "earlier"}))


def test_stale_locks_are_told_from_live_ones_by_process_and_host(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    here = socket.gethostname()
    _write_lock(tmp_path / "dead", here, _dead_pid())  # its process is gone: stale
    lock = RunLock(tmp_path / "dead")
    assert lock.acquire() is None and lock.holder().pid == os.getpid()
    lock.release()
    assert not (tmp_path / "dead" / LOCK_FILE).exists()

    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as live:
        _write_lock(tmp_path / "live", here, live.pid)
        why = RunLock(tmp_path / "live").acquire()
        live.kill()
    assert f"process {live.pid} on {here}" in why and "is still running" in why

    _write_lock(tmp_path / "remote", "node-17", 4242)  # cannot be checked from here
    why = RunLock(tmp_path / "remote").acquire()
    assert "may still be running (another host)" in why and f"delete {tmp_path}/remote" in why

    # The same launch's earlier round (torchrun restarting workers) takes its lock over.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    _write_lock(tmp_path / "round", "node-17", 4242, launch="job-7")
    assert RunLock(tmp_path / "round").acquire() is None


def test_overwrite_removes_only_what_tpplan_wrote(reference_run, tmp_path):
    d = _copy_run(reference_run, tmp_path / "run")
    (d / "notes.txt").write_text("mine")
    (d / "checkpoints" / "README.md").write_text("mine too")
    (d / "checkpoints" / "eval").mkdir()
    ok(tpplan_train(d, "--overwrite", sets=["mesh.tp=1", "train.steps=3"]))
    assert (d / "notes.txt").read_text() == "mine"
    assert (d / "checkpoints" / "README.md").read_text() == "mine too"
    assert (d / "checkpoints" / "eval").is_dir()
    assert [p.name for p in ckpt.complete_checkpoints(d / "checkpoints")] == ["step-000003"]
    assert steps_logged(d) == [1, 2, 3]


def test_a_half_written_metrics_line_does_not_block_resume(reference_run, tmp_path):
    d = _copy_run(reference_run, tmp_path / "run")
    with open(d / "metrics.jsonl", "a") as f:
        f.write('{"step": 13, "loss": 2.')  # killed mid-write
    proc = tpplan_train(d, "--resume", str(d / "checkpoints" / "step-000010"),
                        sets=["mesh.tp=1"])
    ok(proc)
    assert "metrics.jsonl: dropped 3 line(s) past step 10" in proc.stdout
    lines = (d / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, STEPS + 1))
    assert_same_curve(metrics(d), metrics(reference_run), range(1, STEPS + 1), rel=1e-6)


def test_a_diverging_loss_stops_the_run_at_its_step(tmp_path):
    d = tmp_path / "diverged"
    # No weight decay: lr × weight_decay ≥ 1 is refused when the plan is read.
    out = fails(tpplan_train(d, sets=["mesh.tp=1", "train.lr=100000000.0", "train.grad_clip=null",
                                      "train.warmup_steps=0", "train.weight_decay=0"]),
                "training diverged; stopped before the optimizer step")
    step = int(re.search(r"error: step (\d+): loss", out).group(1))
    assert steps_logged(d) == list(range(1, step))  # the diverged step is not a row
    assert not any(p.name == f"step-{step:06d}" for p in (d / "checkpoints").iterdir())


def test_crafted_dcp_metadata_cannot_run_code(reference_run, tmp_path):
    """DCP's ``.metadata`` is a pickle; a crafted one (with a manifest to match, as an attacker
    would write) is refused by tpplan's reader before anything in it is called."""
    d = _copy_run(reference_run, tmp_path / "run")
    newest = d / "checkpoints" / f"step-{STEPS:06d}"
    marker = tmp_path / "code-ran"
    (newest / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest["files"][".metadata"] = ckpt.integrity.hash_files(newest, [".metadata"])[".metadata"]
    (newest / "manifest.json").write_text(json.dumps(manifest))
    proc = tpplan_train(d, "--resume", sets=["mesh.tp=1"])
    ok(proc)
    out = proc.stdout + proc.stderr
    assert f"{newest}/.metadata: cannot be loaded safely (refers to posix.system" in out
    assert "falling back to" in out and not marker.exists()


def test_a_run_started_from_its_own_resolved_plan_does_not_rewrite_it(reference_run, tmp_path):
    d = _copy_run(reference_run, tmp_path / "run")
    before = (d / "plan.yaml").read_bytes()
    ok(tpplan_train(d, "--resume", str(d / "checkpoints" / "step-000010"),
                    sets=["mesh.tp=1"], plan=str(d / "plan.yaml")))
    assert (d / "plan.yaml").read_bytes() == before


def test_validate_reports_the_checkpoint_size_the_preflight_checks(reference_run):
    """The dry run's checkpoint size (what ``train`` checks free space against) held
    against the bytes a real checkpoint of the same plan takes on disk."""
    from helpers import tpplan_cli
    from trainrun import PLAN, TINY

    sets = [a for s in [*TINY, "mesh.tp=1"] for a in ("--set", s)]
    out = tpplan_cli("validate", "--plan", PLAN, "--world-size", "1", "--json", *sets, check=True)
    predicted = json.loads(out.stdout)["checkpoint_bytes"]
    folder = reference_run / "checkpoints" / f"step-{STEPS:06d}"
    real = sum(p.stat().st_size for p in folder.iterdir())
    assert real <= predicted <= real * 1.05, (predicted, real)  # never short, at most 5% over
