"""Two "nodes" on the loopback interface: two torchrun agents meeting through c10d rendezvous,
2 processes each, HSDP with the replica dimension across the nodes -- the launch
docs/training.md gives for a cluster, exercised on one machine.

Both tests end on the single-process reference curve (``reference_run``): one by resuming
a run whose every rank died in its final save, one by surviving a whole node killed and
started again under ``--max-restarts``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from helpers import ROOT, cli_env, tpplan_command
from hooked import DIE_DURING_SAVE, SLOW_STEP
from trainrun import QUICK_START, STEPS, TINY, assert_same_curve, metrics

from tpplan.parallel.runtime import free_port

HSDP = ["mesh.tp=1", "mesh.dp_shard=2", "mesh.dp_replicate=2"]  # replicas = nodes


def _node(run_dir: Path, port: int, launch: str, *extra: str, restarts: int = 0,
          env: dict | None = None) -> subprocess.Popen:
    sets = [f"--set={s}" for s in [*TINY, *QUICK_START, *HSDP, f"metrics.run_dir={run_dir}"]]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={launch}",
           f"--max-restarts={restarts}", *tpplan_command(env), "train", "--plan",
           str(ROOT / "plans" / "llama.yaml"), *sets, *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=cli_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _two_nodes(run_dir: Path, *extra: str, restarts: int = 0, env: dict | None = None,
               ) -> tuple[subprocess.Popen, subprocess.Popen, int, str]:
    """Node A first (it hosts the rendezvous store on the endpoint), then node B."""
    port, launch = free_port(), f"two-nodes-{uuid.uuid4().hex[:8]}"
    a = _node(run_dir, port, launch, *extra, restarts=restarts, env=env)
    _wait_listening(port, a)
    b = _node(run_dir, port, launch, *extra, restarts=restarts, env=env)
    return a, b, port, launch


def _wait_listening(port: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"nothing listens on {port}")


def _finish(*procs: subprocess.Popen, timeout: float = 300) -> list[str]:
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                os.killpg(q.pid, signal.SIGKILL)
            raise
    return outs


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts its workers in sessions of their own,
    so a process group kill would miss them)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            found.append(c)
            todo.append(c)
    return found


def _kill_node(proc: subprocess.Popen) -> None:
    """A node lost: its agent and every worker SIGKILLed at once."""
    for pid in [proc.pid, *_descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def test_two_nodes_train_die_in_a_save_and_resume(reference_run, tmp_path):
    d = tmp_path / "two-nodes"
    a, b, _, _ = _two_nodes(d, env={DIE_DURING_SAVE: str(STEPS)})
    outs = _finish(a, b)
    assert a.returncode != 0 and b.returncode != 0, outs  # every rank died in the save
    assert sorted(metrics(d)) == list(range(1, STEPS + 1))
    a, b, _, _ = _two_nodes(d, "--resume")
    outs = _finish(a, b)
    assert a.returncode == 0 and b.returncode == 0, "\n".join(o[-2000:] for o in outs)
    assert f"resumed from {d / 'checkpoints'}/step-000010 at step 10" in "".join(outs)
    assert "Traceback" not in "".join(outs)
    assert_same_curve(metrics(d), metrics(reference_run), range(1, STEPS + 1))


def test_a_node_killed_and_started_again_under_max_restarts(reference_run, tmp_path):
    """Node B is killed whole after the first checkpoint and started again (a replacement
    node): node A's workers lose their peers, its agent restarts them, both agents meet in
    a new rendezvous round, and the run resumes by itself and ends on the reference curve."""
    d = tmp_path / "node-lost"
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", SLOW_STEP: "0.3"}
    a, b, port, launch = _two_nodes(d, restarts=1, env=env)
    deadline = time.monotonic() + 240
    while not (d / "checkpoints" / "step-000005").is_dir():
        assert time.monotonic() < deadline and a.poll() is None and b.poll() is None
        time.sleep(0.1)
    _kill_node(b)
    b = _node(d, port, launch, restarts=1, env=env)
    outs = _finish(a, b)
    assert a.returncode == 0 and b.returncode == 0, "\n".join(o[-3000:] for o in outs)
    text = "".join(outs)
    assert "restarted by torchrun" in text and "resumed from" in text
    assert sorted(metrics(d)) == list(range(1, STEPS + 1))
    assert_same_curve(metrics(d), metrics(reference_run), range(1, STEPS + 1))
