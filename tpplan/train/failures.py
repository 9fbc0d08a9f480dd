"""How a run's step can fail that is not a bug: a rank out of memory, a peer gone. Each is
told apart from other errors here, so the loop reports it as one line."""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from .setup import Prepared, TrainError

__all__ = ["out_of_memory", "peer_lost"]

_OOM = re.compile(r"can't allocate memory|out of memory|not enough memory", re.IGNORECASE)


def out_of_memory(prep: Prepared, e: RuntimeError) -> TrainError | None:
    """A rank that ran out of memory (CUDA's OutOfMemoryError, the CPU allocator's refusal)
    as one line at the plan's batch keys, None for any other error. How much a step needs
    is known before a run only from the dry run (``tpplan validate --device-memory``); the
    trainer learns it when the allocation fails, so it is caught here, on every phase."""
    text = str(e)
    if not (isinstance(e, torch.OutOfMemoryError) or _OOM.search(text)):
        return None
    tried = re.search(r"allocate (\d+) bytes|allocate ([\d.]+ ?[KMGT]i?B)", text)
    tried = (f"{int(tried.group(1)) / 2**30:,.1f} GiB" if tried.group(1) else tried.group(2)) \
        if tried else None
    t, step = prep.plan.train, prep.step
    key = "micro_batch_size" if "micro_batch_size" in t.locs else "global_batch_size"
    where = t.locs.get(key, t.loc)
    return TrainError(
        f"rank {dist.get_rank()} ran out of memory{f' (tried to allocate {tried})' if tried else ''}: "
        f"each data-parallel rank runs micro-batches of {step.micro_batch} × {t.seq_len} tokens "
        f"(train.{key}{f' at {where}' if where else ''}); lower it, or see the peak per rank "
        f"first: tpplan validate --plan {prep.plan.source} --world-size {dist.get_world_size()} "
        "--device-memory SIZE", every_rank=True)


def peer_lost(e: RuntimeError) -> bool:
    """A collective failed because another rank's process is gone."""
    text = str(e)
    return isinstance(e, dist.DistError) or any(s in text for s in (
        "Connection closed by peer", "Connection reset by peer", "Broken pipe",
        "NCCL communicator was aborted", "remote process exited"))
