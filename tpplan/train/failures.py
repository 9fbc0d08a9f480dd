"""How a run's step can fail that is not a bug: a rank out of memory, a peer gone. Each is
told apart from other errors here, so the loop reports it as one line."""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from .setup import Prepared, TrainError

__all__ = ["not_finite", "out_of_memory", "peer_cause", "peer_lost"]

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


def peer_cause(e: RuntimeError) -> str:
    """The failed collective's own words, short: gloo's source location and its advice
    ("This is typically caused by a remote worker crashing. ...") left out."""
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    first = re.sub(r"^\[[^\]]*:\d+\]\s*", "", first)
    return first.split(". ")[0].strip()[:160]


def not_finite(step: int, loss: float, grad_norm: float, parts: list, optimizers: list,
               last_saved) -> TrainError:
    """A non-finite loss or gradient norm as what it is. Before any update of this process
    (no optimizer step counted yet) the learning rate cannot be the cause: the weights it started
    from, or the forward itself, are -- so the parameters that are not finite are named (every
    rank's, gathered). After updates: training diverged."""
    if any(float(state.get("step", 0)) > 0 for o in optimizers for state in o.state.values()):
        return TrainError(
            f"step {step}: loss {loss}, gradient norm {grad_norm}: training "
            f"diverged; stopped before the optimizer step (last checkpoint: "
            f"{last_saved or 'none'}). Lower train.lr or set train.grad_clip")
    bad = sorted({name for part in parts for name, p in part.named_parameters()
                  if not torch.isfinite(_local(p)).all()})
    if dist.is_initialized():
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, bad)
        bad = sorted({n for names in gathered for n in names})
    what = (f"{len(bad)} parameters are not finite before any update: "
            f"{', '.join(bad[:8])}{' ...' if len(bad) > 8 else ''} (a module whose weights "
            f"nothing initialized, or a checkpoint or pretrained file holding them)") if bad else \
        ("every parameter is finite, so the model's forward gives a non-finite value from "
         "its initial weights and this batch (an overflow, a division by zero, a log of 0)")
    return TrainError(f"step {step}: loss {loss}, gradient norm {grad_norm} before any update "
                      f"(not a learning-rate problem): {what}")


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p
