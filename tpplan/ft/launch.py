"""Starting a fault-tolerant run on one machine: the lighthouse, then one torchrun per group.

On a cluster the same pieces run apart: ``tpplan lighthouse`` on one host, and on each replica
group's nodes ``TPPLAN_REPLICA_GROUP=g TORCHFT_LIGHTHOUSE=http://host:29510 torchrun ...
-m tpplan train --plan p.yaml`` (docs/fault-tolerance.md has the SLURM form).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from .groups import ENV_GROUP, ENV_LIGHTHOUSE, ENV_START

__all__ = ["lighthouse_argv", "start_groups", "start_lighthouse", "torchrun_argv"]


def lighthouse_argv(spec, port: int) -> list[str]:
    """torchft's lighthouse binary (installed with it) with the plan's settings; a quorum
    needs ``min_replicas`` groups."""
    exe = shutil.which("torchft_lighthouse") or str(Path(sys.executable).parent / "torchft_lighthouse")
    return [exe, f"--bind=[::]:{port}", f"--min_replicas={spec.min_replicas}", "--quorum_tick_ms=50",
            f"--join_timeout_ms={int(spec.join_timeout_s * 1000)}",
            f"--heartbeat_timeout_ms={int(spec.heartbeat_timeout_s * 1000)}"]


def start_lighthouse(spec, log: Path) -> tuple[subprocess.Popen, str]:
    """The lighthouse for a run on this machine, its log in ``log`` (every quorum it forms);
    returns the process and the address the groups dial, once it listens."""
    with socket.socket() as s:  # a free port (the lighthouse binds it right after)
        s.bind(("", 0))
        port = s.getsockname()[1]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(lighthouse_argv(spec, port), stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(OSError), socket.create_connection(("localhost", port), timeout=1):
            return proc, f"http://{socket.gethostname()}:{port}"
        time.sleep(0.05)
    proc.kill()
    raise OSError(f"torchft's lighthouse did not start (its log: {log})")


def torchrun_argv(nproc: int, max_restarts: int, worker: Sequence[str], train_args: Sequence[str],
                  extra: Sequence[str] = ()) -> list[str]:
    """One group's torchrun (:mod:`tpplan.ft.torchrun`: its end an exit code, not a traceback):
    its own rendezvous on a free port, ``--max-restarts`` of its own."""
    return [sys.executable, "-m", "tpplan.ft.torchrun", "--nnodes=1", "--rdzv-backend=c10d",
            "--rdzv-endpoint=localhost:0", f"--rdzv-id=tpplan-{uuid.uuid4().hex[:12]}",
            f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}", *extra, *worker, *train_args]


def start_groups(groups: int, lighthouse: str, argv_of) -> tuple[list[subprocess.Popen], object]:
    """Start group g's torchrun (``argv_of(g)``) with its index and the lighthouse in its
    environment; output goes where this process's goes. Returns the processes and the store
    their first rounds meet at (alive as long as the caller holds it)."""
    from torch.distributed import TCPStore

    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    procs = []
    for g in range(groups):
        env = dict(os.environ, **{ENV_GROUP: str(g), ENV_LIGHTHOUSE: lighthouse,
                                  ENV_START: f"localhost:{store.port}"})
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("RUST_LOG", "warn")  # torchft's manager servers: warnings only
        procs.append(subprocess.Popen(argv_of(g), env=env))
    return procs, store
