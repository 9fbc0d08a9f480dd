"""Process group start-up: torchrun's environment, a single process on its own, or N local
processes spawned for a test or ``tpplan verify``."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

__all__ = ["default_device_type", "ensure_process_group", "free_port", "spawn"]


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
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    return dist.get_world_size()


def spawn(fn, world_size: int, *args) -> None:
    """Run ``fn(rank, world_size, port, *args)`` in ``world_size`` fresh processes."""
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for attempt in range(3):
        try:
            mp.start_processes(fn, args=(world_size, free_port(), *args), nprocs=world_size,
                               start_method="spawn")
            return
        except mp.ProcessRaisedException as e:
            # The free port can be taken between our probe and rank 0's bind; try another.
            if "EADDRINUSE" not in str(e) or attempt == 2:
                raise
