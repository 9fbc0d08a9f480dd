"""A run's checkpoints: resumable, reshardable, atomic, with ``torch.distributed.checkpoint`` (DCP).

Layout of one checkpoint, ``<dir>/step-000010/``: DCP's shards and ``.metadata`` for the
model and optimizer (saved through ``get_state_dict``, so loading onto another mesh shape
reshards), and ``trainer.pt`` (step, schedule, data position, RNG, model shapes) written by
rank 0 last.

Atomic: every rank writes into ``step-000010.tmp``; after a barrier rank 0 writes
``trainer.pt`` and renames the folder. Only folders without ``.tmp`` that hold both
``.metadata`` and ``trainer.pt`` count as complete, so a run killed mid-save leaves the
previous checkpoint as the latest.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

__all__ = [
    "DIE_DURING_SAVE_ENV",
    "TRAINER_FILE",
    "find_checkpoint",
    "is_complete",
    "latest",
    "load",
    "model_shapes",
    "read_model_state",
    "read_trainer_state",
    "save",
]

TRAINER_FILE = "trainer.pt"
MODEL_KEY = "model"  # the trainer saves {"model": ..., "optim": ...}
STEP_DIR = re.compile(r"^step-(\d+)$")
# Test hook: the step whose save dies after the shards are written, before completion.
DIE_DURING_SAVE_ENV = "TPPLAN_TEST_DIE_DURING_SAVE"


def model_shapes(model: nn.Module) -> dict[str, list[int]]:
    """Global parameter shapes (a DTensor's ``shape`` is the global one)."""
    return {n: list(p.shape) for n, p in model.named_parameters()}


def is_complete(path: Path) -> bool:
    return (STEP_DIR.match(path.name) is not None and (path / ".metadata").is_file()
            and (path / TRAINER_FILE).is_file())


def latest(ckpt_dir: Path) -> Path | None:
    """The complete checkpoint with the highest step in ``ckpt_dir``, if any."""
    if not ckpt_dir.is_dir():
        return None
    done = [p for p in ckpt_dir.iterdir() if p.is_dir() and is_complete(p)]
    return max(done, key=lambda p: int(STEP_DIR.match(p.name).group(1)), default=None)


def find_checkpoint(path: Path) -> Path | None:
    """``path`` itself if it is a complete step folder, else the latest complete one in it
    or in its ``checkpoints/`` (a run folder); None if there is none."""
    path = Path(path)
    if is_complete(path):
        return path
    return latest(path) or latest(path / "checkpoints")


def read_trainer_state(path: Path) -> dict[str, Any]:
    return torch.load(path / TRAINER_FILE, weights_only=False)


def save(ckpt_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
         trainer_state: dict[str, Any], keep: int) -> Path:
    """Save collectively (every rank calls it); return the final folder."""
    rank = dist.get_rank()
    final = ckpt_dir / f"step-{step:06d}"
    tmp = ckpt_dir / f"step-{step:06d}.tmp"
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed mid-save
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({MODEL_KEY: model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    if os.environ.get(DIE_DURING_SAVE_ENV) == str(step):
        os._exit(17)  # simulates a kill between the shards and completion
    dist.barrier()  # every rank's shards are on disk before the folder is declared complete
    if rank == 0:
        torch.save(trainer_state, tmp / TRAINER_FILE)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _prune(ckpt_dir, keep)
    dist.barrier()
    return final


def _prune(ckpt_dir: Path, keep: int) -> None:
    if keep <= 0:
        return
    done = sorted((p for p in ckpt_dir.iterdir() if p.is_dir() and is_complete(p)),
                  key=lambda p: int(STEP_DIR.match(p.name).group(1)))
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Load model and optimizer (resharded onto this mesh) and return the trainer state."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {MODEL_KEY: model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state[MODEL_KEY],
                   optim_state_dict=state["optim"])
    return read_trainer_state(path)


def read_model_state(path: Path) -> dict[str, torch.Tensor]:
    """Full (unsharded) model tensors of a checkpoint, on the CPU, in one process without a
    process group: DCP's metadata gives every global shape, DCP reads each shard into place,
    and only the model's entries are read, never the optimizer state. Empty if it holds none."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(path))
    meta = reader.read_metadata().state_dict_metadata
    prefix = MODEL_KEY + "."
    state = {key[len(prefix):]: torch.empty(m.size, dtype=m.properties.dtype)
             for key, m in meta.items()
             if key.startswith(prefix) and isinstance(m, TensorStorageMetadata)}
    if not state:
        return state
    wrapped = {MODEL_KEY: state}
    with warnings.catch_warnings():  # "assuming ... a single process": yes, that is the point
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.load(wrapped, storage_reader=reader)
    return wrapped[MODEL_KEY]
