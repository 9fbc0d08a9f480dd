"""Process group start-up: torchrun's environment, or a single process on its own."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

__all__ = ["default_device_type", "ensure_process_group", "free_port"]


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
