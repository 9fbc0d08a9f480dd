"""Process group start-up: torchrun's environment, a single process on its own, or N local
processes spawned for a test or ``tpplan verify``.

Restarts under ``torchrun --max-restarts``: by default torchrun's workers share the agent's
TCPStore, and a restarted round finds the previous round's keys still there -- gloo then
connects to the dead workers' addresses (``connectFullMesh failed ... Connection refused``).
On one node every worker sees the same ``TORCHELASTIC_RESTART_COUNT``, so each round gets
its own key prefix. Across nodes the count differs per node (only the failed node's agent
counts a restart), so there the launch must give every round a fresh store:
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in torchrun's environment (docs/training.md).
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist

__all__ = ["as_spawned_rank", "default_device_type", "ensure_process_group", "free_port",
           "restart_problem", "spawn"]


def default_device_type() -> str:
    """``cuda`` where a GPU is present, else ``cpu``; ``TPPLAN_DEVICE`` overrides."""
    forced = os.environ.get("TPPLAN_DEVICE")
    if forced:
        return forced
    return "cuda" if torch.cuda.is_available() else "cpu"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_process_group(device_type: str) -> int:
    """Start the default process group unless one is running; return the world size.

    Under torchrun the rendezvous variables are set; a plain ``python`` run becomes a
    world of one. The backend is nccl for CUDA and gloo otherwise.
    """
    if dist.is_initialized():
        return dist.get_world_size()
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = "nccl" if device_type == "cuda" else "gloo"
    store = _restart_round_store()
    if store is None:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
    return dist.get_world_size()


def _restart_round_store():
    """torchrun's shared agent store under a prefix of its own for a restarted round on a
    single node; None where the default ``env://`` start is right."""
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or count == "0"
            or os.environ.get("GROUP_WORLD_SIZE", "1") != "1"):
        return None
    from datetime import timedelta

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False,
                          timeout=timedelta(minutes=10))
    return dist.PrefixStore(f"tpplan/restart-round-{count}/", store)


def restart_problem() -> str | None:
    """Why restarts of this torchrun launch would fail, before they are needed: several
    nodes sharing the agent's store with ``--max-restarts`` > 0."""
    if (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
            and int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1):
        return ("torchrun --max-restarts across several nodes needs "
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment (otherwise a "
                "restarted round reuses the dead workers' addresses and gloo cannot connect; "
                "see docs/training.md, 'Restarts')")
    return None


def as_spawned_rank(rank: int, world: int, port: int) -> None:
    """Inside a :func:`spawn`-ed worker: the environment torchrun would have given rank
    ``rank`` of ``world`` on this host (``init_process_group`` reads it), one CPU thread."""
    import torch

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)


# What a forkserver imports once, so the ranks it forks start with torch and tpplan loaded
# (four ``spawn``-ed ranks each import torch: about 10 s on 2 cores; forked: a tenth of one).
_PRELOAD = ["torch", "torch.distributed.tensor", "torch.distributed.checkpoint",
            "torch.distributed.fsdp", "tpplan.models", "tpplan.analysis.verify.numerics"]
# ...and, where the process asking for the ranks has imported it, transformers' model base
# (about 2 CPU-s to import after torch: a HuggingFace model's four ranks would each pay it).
_PRELOAD_IF_IMPORTED = ["transformers.modeling_utils"]


class _InEnvironment:
    """``fn`` called with the environment of the process that asked for the ranks: a
    forkserver's children inherit the server's, taken when it started."""

    def __init__(self, fn, environ: dict[str, str]):
        self.fn, self.environ = fn, environ

    def __call__(self, *args):
        os.environ.clear()
        os.environ.update(self.environ)
        return self.fn(*args)


def spawn(fn, world_size: int, *args) -> None:
    """Run ``fn(rank, world_size, port, *args)`` in ``world_size`` fresh processes: forked
    from a server that has torch and tpplan imported where the platform has one (Linux,
    macOS), else spawned. Each starts in this process's working folder and environment.
    The server starts at the first call and lives as long as this process: transformers'
    model base is in it where this process had imported that by then."""
    import multiprocessing

    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    method = "spawn"
    if "forkserver" in multiprocessing.get_all_start_methods():
        method = "forkserver"
        multiprocessing.set_forkserver_preload(  # read when the server starts
            _PRELOAD + [m for m in _PRELOAD_IF_IMPORTED if m in sys.modules])
    for attempt in range(3):
        try:
            mp.start_processes(_InEnvironment(fn, dict(os.environ)),
                               args=(world_size, free_port(), *args), nprocs=world_size,
                               start_method=method)
            return
        except mp.ProcessRaisedException as e:
            # The free port can be taken between our probe and rank 0's bind; try another.
            if "EADDRINUSE" not in str(e) or attempt == 2:
                raise
