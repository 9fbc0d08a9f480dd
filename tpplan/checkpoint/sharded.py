"""A run's checkpoints: resumable, reshardable, atomic, verified, with ``torch.distributed.checkpoint`` (DCP).

Layout of one checkpoint, ``<dir>/step-000010/``: DCP's shards and ``.metadata`` for the
model and optimizer (saved through ``get_state_dict``, so loading onto another mesh shape
reshards), ``trainer.json`` (step, schedule, data position, RNG, model shapes) and
``manifest.json`` (every file's size and SHA-256, see :mod:`.integrity`), written last.

Atomic: every rank writes into ``step-000010.tmp``; after every rank's shards are hashed,
rank 0 writes the trainer state and the manifest and renames the folder. Only folders
without ``.tmp`` that hold ``.metadata``, the trainer state and the manifest count as
complete, so a run killed mid-save leaves the previous checkpoint as the latest. A save
that fails on any rank (disk full, permissions) fails on every rank alike with one
message, and its ``.tmp`` folder is removed.
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
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from .integrity import (
    LEGACY_TRAINER_FILE, MANIFEST_FILE, TRAINER_FILE, Damaged, SafeReader, hash_files,
    read_trainer_state, write_manifest, write_trainer_state,
)
from .packed_io import PackedLoadPlanner, PackedSavePlanner, packed_of

__all__ = [
    "SaveFailed",
    "TRAINER_FILE",
    "checkpoint_bytes",
    "complete_checkpoints",
    "find_checkpoint",
    "is_complete",
    "is_step_folder",
    "latest",
    "load",
    "model_shapes",
    "read_model_state",
    "read_trainer_state",
    "save",
    "step_of",
]

PER_TENSOR_BYTES = 2304  # DCP's per-tensor record + metadata entry (measured ~2.1 KiB)
# The flattened optimizer state (FLAT) saves each parameter's copy of its group's settings:
# AdamW's 11 and LambdaLR's initial_lr, each a pickled object and a metadata entry
# (measured 1.3-1.45 KiB with short names).
GROUP_KEYS = 12
PER_OBJECT_BYTES = 1536
FIXED_BYTES = 16 << 10  # trainer.json (its RNG state is 10 KiB of hex) and manifest.json
MODEL_KEY = "model"  # the trainer saves {"model": ..., "optim": ...}
STEP_DIR = re.compile(r"^step-(\d+)$")
# One model, or a pipeline rank's stage modules (each with its own optimizer).
Parts = nn.Module | list[nn.Module]
Optimizers = torch.optim.Optimizer | list[torch.optim.Optimizer]
# Optimizer state keyed by each parameter's name (``state.layers.3.attention.wq.weight.exp_avg``),
# not by position in one optimizer: a checkpoint of pp=2 stages loads onto pp=4 or none.
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class SaveFailed(Exception):
    """A save that failed on some rank; raised on every rank with the same message."""


def model_shapes(model: Parts) -> dict[str, list[int]]:
    """Global parameter shapes (a DTensor's ``shape`` is the global one)."""
    models = model if isinstance(model, list) else [model]
    return {n: list(p.shape) for m in models for n, p in m.named_parameters()}


def checkpoint_bytes(model: nn.Module, optimizer_states: int = 2, saved: list | None = None) -> int:
    """Bytes one checkpoint of ``model`` takes on disk: every parameter once and
    ``optimizer_states`` tensors of its size (AdamW: two moments), from the global shapes
    (works on the meta device), plus what DCP and tpplan add -- per saved tensor (AdamW's
    step counter included) a ``torch.save`` record and a ``.metadata`` entry, about 2.1 KiB
    measured, counted as 2.25 KiB; per parameter its optimizer group's settings -- and the
    trainer state and manifest. ``saved``: (elements, element bytes) of what LoRA holds."""
    params = saved or [(p.numel(), p.element_size()) for p in model.parameters()]
    data = sum(n * size * (1 + optimizer_states) for n, size in params)
    return (data + len(params) * (2 + optimizer_states) * PER_TENSOR_BYTES
            + len(params) * GROUP_KEYS * PER_OBJECT_BYTES + FIXED_BYTES)


def is_step_folder(path: Path) -> bool:
    """A folder this module writes: ``step-NNNNNN``, or its ``.tmp`` while being saved."""
    return STEP_DIR.match(path.name.removesuffix(".tmp")) is not None


def step_of(path: Path) -> int:
    return int(STEP_DIR.match(path.name).group(1))


def is_complete(path: Path) -> bool:
    """Finished writing (the rename happened and every part is there); not yet verified."""
    legacy = (path / LEGACY_TRAINER_FILE).is_file() and not (path / TRAINER_FILE).exists()
    return (STEP_DIR.match(path.name) is not None and (path / ".metadata").is_file()
            and ((path / TRAINER_FILE).is_file() and (path / MANIFEST_FILE).is_file()
                 or legacy))


def complete_checkpoints(ckpt_dir: Path) -> list[Path]:
    """The complete checkpoints in ``ckpt_dir``, newest first."""
    if not ckpt_dir.is_dir():
        return []
    done = [p for p in ckpt_dir.iterdir() if p.is_dir() and is_complete(p)]
    return sorted(done, key=step_of, reverse=True)


def latest(ckpt_dir: Path) -> Path | None:
    """The complete checkpoint with the highest step in ``ckpt_dir``, if any."""
    done = complete_checkpoints(ckpt_dir)
    return done[0] if done else None


def find_checkpoint(path: Path) -> Path | None:
    """``path`` itself if it is a complete step folder, else the latest complete one in it
    or in its ``checkpoints/`` (a run folder); None if there is none."""
    path = Path(path)
    if is_complete(path):
        return path
    return latest(path) or latest(path / "checkpoints")


def _agree(problem: str | None) -> str | None:
    """Every rank's problem (or None) -> the first one, on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return problem
    everyone: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problem)
    return next((p for p in everyone if p), None)


def _describe(e: BaseException) -> str:
    """One line for an exception; DCP's CheckpointException carries one per failed rank."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, wrapped = min(failures.items())
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        return f"{_describe(inner)} (rank {rank}" + (
            f" and {len(failures) - 1} more)" if len(failures) > 1 else ")")
    if isinstance(e, Damaged):
        return str(e)
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}" + (f": {e.filename}" if e.filename else "")
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__


def _full_disk(folder: Path) -> str | None:
    """Why a write failed when the disk filled up: torch.save's zip writer reports a short
    write as "unexpected pos", not as ENOSPC."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return None
    return f"No space left on device ({free >> 10} KiB free in {folder})" if free < 1 << 20 \
        else None


def _attempt(fn, *args, **kwargs) -> str | None:
    try:
        fn(*args, **kwargs)
    # DCP's CheckpointException derives from BaseException, not Exception.
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - one line on every rank
        return _describe(e)
    return None


def save(ckpt_dir: Path, step: int, model: Parts, optimizer: Optimizers,
         trainer_state: dict[str, Any], keep: int, trained_only: bool = False) -> Path:
    """Save collectively (every rank calls it); return the final folder. Raises
    :class:`SaveFailed` on every rank if any rank fails; the ``.tmp`` folder is removed and
    earlier checkpoints are untouched. ``trained_only``: of the model, what trains (LoRA)."""
    rank = dist.get_rank()
    final = ckpt_dir / f"step-{step:06d}"
    tmp = ckpt_dir / f"step-{step:06d}.tmp"

    def fail(problem: str):
        full = _full_disk(ckpt_dir) if rank == 0 else None  # before the .tmp is freed
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if full := _agree(full):
            problem = problem if "No space left" in problem else f"{full} ({problem})"
        raise SaveFailed(f"checkpoint of step {step} not saved: {problem}")

    def prepare_folder():
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed mid-save

    if problem := _agree(_attempt(prepare_folder) if rank == 0 else None):
        fail(problem)
    model_sd, optim_sd = _merged(_state_dicts(model, optimizer, trained_only))
    # packed parameters are written in the model's order, whatever the tp (packed_io)
    if problem := _agree(_attempt(dcp.save, {MODEL_KEY: model_sd, "optim": optim_sd},
                                  checkpoint_id=str(tmp),
                                  planner=PackedSavePlanner(packed_of(model)))):
        fail(problem)  # DCP raises on every rank when any rank fails; agreed anyway
    own: dict[str, Any] = {}

    def hash_own():  # this rank's shards, hashed in parallel with every other rank's
        own.update(hash_files(tmp, sorted(p.name for p in tmp.glob(f"__{rank}_*.distcp"))))

    problem = _attempt(hash_own)
    hashed: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hashed, (problem, own))
    if problem := next((p for p, _ in hashed if p), None):
        fail(problem)

    def complete():
        write_trainer_state(tmp, trainer_state)
        write_manifest(tmp, {k: v for _, part in hashed for k, v in part.items()})
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _prune(ckpt_dir, keep)

    if problem := _agree(_attempt(complete) if rank == 0 else None):
        fail(problem)
    return final


def _prune(ckpt_dir: Path, keep: int) -> None:
    if keep <= 0:
        return
    for old in complete_checkpoints(ckpt_dir)[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def load(path: Path, model: Parts, optimizer: Optimizers, trained_only: bool = False) -> dict:
    """Load model and optimizer (resharded onto this mesh, and onto these pipeline stages)
    and return the trainer state; ``trained_only`` as saved (the rest keeps its values)."""
    parts = _state_dicts(model, optimizer, trained_only)
    model_sd, optim_sd = _merged(parts)
    state = {MODEL_KEY: model_sd, "optim": optim_sd}
    if problem := _agree(_attempt(dcp.load, state, storage_reader=SafeReader(str(path)),
                                  planner=PackedLoadPlanner(packed_of(model)))):
        raise Damaged(path, f"cannot be loaded: {problem}")
    for (m, o), (msd, osd) in zip(_pairs(model, optimizer), parts):
        set_state_dict(m, o, model_state_dict={k: state[MODEL_KEY][k] for k in msd},
                       optim_state_dict={k: state["optim"][k] for k in osd},
                       options=StateDictOptions(flatten_optimizer_state_dict=True, strict=not trained_only))
    return read_trainer_state(path)


def _pairs(model: Parts, optimizer: Optimizers) -> list[tuple[nn.Module, torch.optim.Optimizer]]:
    models = model if isinstance(model, list) else [model]
    optims = optimizer if isinstance(optimizer, list) else [optimizer]
    return list(zip(models, optims, strict=True))


def _state_dicts(model: Parts, optimizer: Optimizers, trained_only: bool = False) -> list[tuple[dict, dict]]:
    dicts = [(m, *get_state_dict(m, o, options=FLAT)) for m, o in _pairs(model, optimizer)]
    trained = {n for m, *_ in dicts for n, p in m.named_parameters() if p.requires_grad}
    return [({k: v for k, v in msd.items() if not trained_only or k in trained}, osd)
            for _, msd, osd in dicts]


def _merged(parts: list[tuple[dict, dict]]) -> tuple[dict, dict]:
    """The parts' state dicts as one: names are the whole model's, so they never collide."""
    model_sd, optim_sd = {}, {}
    for msd, osd in parts:
        model_sd.update(msd)
        optim_sd.update(osd)
    return model_sd, optim_sd


def read_model_state(path: Path) -> dict[str, torch.Tensor]:
    """Full (unsharded) model tensors of a checkpoint, on the CPU, in one process without a
    process group: DCP's metadata gives every global shape, DCP reads each shard into place,
    and only the model's entries are read, never the optimizer state. Empty if it holds none."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = SafeReader(str(path))
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
