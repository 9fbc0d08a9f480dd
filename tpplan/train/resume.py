"""Claiming the run folder and choosing the checkpoint to resume from, once the process
group is up, so every rank acts on one decision.

Rank 0 takes the run folder's lock; then the candidates (newest first, from
:func:`~tpplan.train.setup.prepare`) are checked in turn -- sizes and trainer state on rank
0, every file's SHA-256 by all ranks together -- and the first intact one is used. Each
damaged checkpoint is named with its file and problem; when none is left the run stops with
one line. A checkpoint of a different model is the user's mistake, not damage: it stops the
run instead of falling back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from .. import checkpoint as ckpt
from .runfolder import RunLock
from .setup import Prepared, TrainError

__all__ = ["Claim", "claim"]


class Claim:
    def __init__(self, lock: RunLock):
        self.lock = lock
        self.resume_from: Path | None = None
        self.state: dict[str, Any] | None = None  # the chosen checkpoint's trainer state
        self.notes: list[str] = []


def _broadcast(obj: Any) -> Any:
    if dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _different_model(path: Path, saved: dict, model: nn.Module) -> str | None:
    now = ckpt.model_shapes(model)
    saved = saved.get("model_shapes", now)
    if saved == now:
        return None
    diff = [n for n in sorted(saved.keys() | now.keys()) if saved.get(n) != now.get(n)]
    shown = ", ".join(f"{n}: saved {saved.get(n)} vs now {now.get(n)}" for n in diff[:4])
    return (f"checkpoint {path} is from a different model ({len(diff)} parameters differ: "
            f"{shown}{' ...' if len(diff) > 4 else ''})")


def _other_base(path: Path, state: dict, base: dict | None) -> str | None:
    """A LoRA checkpoint holds adapters only: they continue on the base they were trained on."""
    saved = state.get("lora_base")
    if base is None or saved is None or saved == base:
        return None
    def show(b: dict) -> str:
        return (f"{b['pretrained']} ({b.get('file')} sha256 {b.get('sha256', '')[:12]})"
                if b.get("pretrained") else f"a random base of seed {b.get('seed')}")
    return (f"checkpoint {path} holds LoRA adapters trained on {show(saved)}, but this plan's "
            f"base is {show(base)}: resume on the same base, or start a new run")


def _structure(path: Path, model: nn.Module) -> tuple[str | None, str | None, dict | None]:
    """Rank 0: (damage, user error, trainer state) of one candidate."""
    try:
        state = ckpt.check_structure(path)
    except ckpt.Damaged as e:
        return str(e), None, None
    return None, _different_model(path, state, model), state


def claim(prep: Prepared, model: nn.Module) -> Claim:
    """Collective. Raises :class:`TrainError` on every rank when the folder is taken, the
    checkpoint is of another model, or no intact checkpoint is left."""
    rank = dist.get_rank()
    c = Claim(RunLock(prep.run_dir))
    if rank == 0:
        prep.run_dir.mkdir(parents=True, exist_ok=True)
    if problem := _broadcast(c.lock.acquire() if rank == 0 else None):
        raise TrainError(problem)
    damaged: list[str] = []
    for path in prep.candidates:
        found = _broadcast(_structure(path, model) if rank == 0 else None)
        damage, user_error, state = found
        if user_error:
            raise TrainError(user_error)
        if damage is None and prep.plan.checkpoint.verify:
            problems = ckpt.check_contents(path)
            damage = problems[0] if problems else None
        if damage is None:
            if problem := _other_base(path, state, prep.lora_base):
                raise TrainError(problem)
            c.resume_from, c.state = path, state
            break
        damaged.append(damage)
        c.notes.append(f"checkpoint {path.name} is damaged, not used: {damage}")
    if prep.candidates and c.resume_from is None:
        if prep.explicit or len(prep.candidates) == 1:
            raise TrainError(f"cannot resume: {damaged[0]}")
        raise TrainError(f"cannot resume: none of the {len(damaged)} complete checkpoints in "
                         f"{prep.candidates[0].parent} is intact (newest: {damaged[0]})")
    if c.resume_from is not None and c.notes:
        c.notes.append(f"falling back to {c.resume_from}")
    return c
