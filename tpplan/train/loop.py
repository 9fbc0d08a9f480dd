"""The training loop: a client of the public API (load, build_mesh, apply, loss_context).

Order: check everything (no process group yet) -> mesh -> ``plan.apply`` on the meta
model -> ``to_empty`` + seeded init -> AdamW + warmup/cosine -> resume -> steps with
gradient accumulation and clipping -> DCP checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from .. import checkpoint as ckpt
from ..models import init_weights, materialize
from ..parallel.mesh import dp_rank as data_parallel_rank
from ..parallel.runtime import default_device_type
from .data import local_batch
from .progress import GPU_ONLY, Reporter, peak_flops
from .setup import Prepared, prepare

__all__ = ["clip_grad_norm", "lr_lambda", "train"]

RECORD_BATCHES_ENV = "TPPLAN_RECORD_BATCHES"  # test hook: each rank logs a digest per batch


def lr_lambda(step: int, warmup: int, total: int, lr: float, min_lr: float) -> float:
    """Multiplier of ``lr`` at optimizer step ``step`` (0-based): linear warmup, then cosine
    from ``lr`` down to ``min_lr`` at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    span = max(total - warmup, 1)
    progress = min((step - warmup) / span, 1.0)
    floor = min_lr / lr
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def clip_grad_norm(params: Iterable[nn.Parameter], max_norm: float | None) -> float:
    """Global L2 norm of all gradients (clipped to ``max_norm`` if given), correct for
    DTensor gradients on any mix of meshes and placements.

    Norms are computed per (mesh, placements) group -- a group's norm of sharded DTensors is
    a Partial DTensor and ``full_tensor()`` reduces it over exactly the ranks that hold
    shards -- then combined as the root of the sum of squares. One ``get_total_norm`` over
    mixed groups would fail or double-count.
    """
    params = [p for p in params if p.grad is not None]
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        g = p.grad
        key = (g.device_mesh, g.placements) if isinstance(g, DTensor) else g.device
        groups[key].append(g)
    squares = []
    for grads in groups.values():
        n = torch.nn.utils.get_total_norm(grads, 2.0)
        if isinstance(n, DTensor):
            n = n.full_tensor()
        squares.append(n.float() ** 2)
    total = torch.stack([s.cpu() for s in squares]).sum().sqrt() if squares else torch.zeros(())
    if max_norm is not None:
        coef = min(max_norm / (float(total) + 1e-6), 1.0)
        if coef < 1.0:
            for p in params:
                p.grad.mul_(coef)
    return float(total)


def _to_local_scalar(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _flops_per_token(model: nn.Module, n_params: int, seq_len: int) -> float:
    # 6N for the matmuls forward+backward, plus attention's 12·L·d·s (PaLM appendix B).
    cfg = getattr(model, "config", None)
    attn = 12 * cfg.n_layers * cfg.dim * seq_len if cfg is not None and hasattr(cfg, "dim") else 0
    return 6 * n_params + attn


def train(plan_path: str, overrides: Sequence[str] = (), resume: str | None = None,
          overwrite: bool = False, device_type: str | None = None) -> dict:
    """Run ``tpplan train`` in this process (one rank of torchrun, or a world of one).

    Raises :class:`~tpplan.plan.errors.PlanErrors` / :class:`~tpplan.train.setup.TrainError`
    before any collective for a mistake in the plan, the data or the checkpoint. Returns
    the summary shown at the end, plus ``losses`` and ``step_times`` per step.
    """
    _quiet_known_warnings()
    prep = prepare(plan_path, overrides, resume, overwrite)
    device_type = device_type or default_device_type()
    owned = not dist.is_initialized()  # a caller's own process group is left running
    mesh = prep.plan.build_mesh(device_type)
    try:
        return _run(prep, mesh, device_type, overwrite)
    finally:
        if owned and dist.is_initialized():
            dist.destroy_process_group()


def _quiet_known_warnings() -> None:
    import logging
    import warnings

    # The embedding returns a view; the Llama never modifies it in place, so FSDP2's warning
    # about in-place ops on it does not apply. And DTensor warns per grad-norm reduction on
    # a 2-D mesh that two all-reduces run; it is one scalar per step.
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def _run(prep: Prepared, mesh, device_type: str, overwrite: bool) -> dict:
    plan, dims, t = prep.plan, prep.dims, prep.plan.train
    accum, micro_size = prep.step.grad_accum, prep.step.micro_batch
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(device_type, torch.cuda.current_device()) \
        if device_type == "cuda" else torch.device(device_type)
    if rank == 0:
        if overwrite and prep.resume_from is None:
            shutil.rmtree(prep.ckpt_dir, ignore_errors=True)
        prep.run_dir.mkdir(parents=True, exist_ok=True)
        _write_plan(prep)
        _trim_metrics(prep.run_dir, _resume_step(prep))
    dist.barrier()

    model = plan.apply(prep.model, mesh)
    materialize(model, device)
    init_method = init_weights(model, t.seed, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=t.betas, eps=t.eps,
                                  weight_decay=t.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(s, t.warmup_steps, t.steps, t.lr, t.min_lr))
    start = 0
    if prep.resume_from is not None:
        state = ckpt.load(prep.resume_from, model, optimizer)
        schedule.load_state_dict(state["schedule"])
        torch.set_rng_state(state["rng"])
        start = state["step"]

    dp_rank, tp_rank = data_parallel_rank(mesh), mesh["tp"].get_local_rank()
    n_params = sum(p.numel() for p in model.parameters())
    tokens_per_step = t.global_batch_size * t.seq_len
    peak = peak_flops(device_type)
    flops_token = _flops_per_token(model, n_params, t.seq_len)
    header = (f"tpplan train: {plan.source} | {dims} on {world} {device_type} ranks | "
              f"{n_params / 1e6:.2f}M params ({init_method} init) | data {prep.corpus.source}, "
              f"{len(prep.corpus) / 1e6:.2f}M tokens | global batch {t.global_batch_size}×"
              f"{t.seq_len} = {accum} micro-batch(es) of {micro_size} per dp rank | "
              f"run folder {prep.run_dir}")
    if prep.resume_from is not None:
        header += f"\nresumed from {prep.resume_from} at step {start}"
    reporter = Reporter(prep.run_dir, t.steps, start, rank == 0, header)
    record = _batch_recorder(prep, rank, dp_rank, tp_rank)
    can_skip_sync = hasattr(model, "set_requires_gradient_sync") and accum > 1
    times, losses, last_saved = [], [], None

    for step in range(start + 1, t.steps + 1):
        t0 = time.perf_counter()
        batch = local_batch(prep.corpus, t.seed, step, t.global_batch_size, t.seq_len,
                            dp_rank, dims.dp)
        record(step, batch)
        batch = batch.to(device)
        loss_sum = torch.zeros((), device=device)
        for m in range(accum):
            micro = batch[m * micro_size:(m + 1) * micro_size]
            if can_skip_sync:  # reduce-scatter gradients once, on the last micro-batch
                model.set_requires_gradient_sync(m == accum - 1)
            with plan.loss_context():
                logits = model(micro[:, :-1])
                # Mean over this micro-batch / accum: the sum over micro-batches is the mean
                # over the rank's batch, and FSDP's average over dp ranks the global mean.
                loss = F.cross_entropy(logits.flatten(0, 1).float(),
                                       micro[:, 1:].flatten()) / accum
                loss.backward()
            loss_sum += _to_local_scalar(loss.detach())
        grad_norm = clip_grad_norm(model.parameters(), t.grad_clip)
        lr = schedule.get_last_lr()[0]
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        # TP peers hold the same loss, so the world mean is the mean over dp ranks.
        dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
        loss_value = loss_sum.item() / world
        if device_type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        times.append(dt)
        losses.append(loss_value)
        row = {"step": step, "loss": loss_value, "grad_norm": grad_norm, "lr": lr,
               "step_time_s": dt, "tokens_per_s": tokens_per_step / dt,
               "tokens_per_s_per_device": tokens_per_step / dt / world}
        if device_type == "cuda":
            row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
            row["mfu"] = flops_token * tokens_per_step / dt / world / peak if peak else None
        reporter.log(row, show=step % plan.metrics.log_interval == 0 or step == t.steps)
        interval = plan.checkpoint.interval
        if plan.checkpoint.enabled and ((interval and step % interval == 0) or step == t.steps):
            state = {"step": step, "schedule": schedule.state_dict(), "data_step": step,
                     "rng": torch.get_rng_state(), "model_shapes": ckpt.model_shapes(model),
                     "mesh": dims.as_dict(), "plan": plan.source}
            last_saved = ckpt.save(prep.ckpt_dir, step, model, optimizer, state,
                                   plan.checkpoint.keep)

    steady = times[1:] or times
    mean_dt = sum(steady) / max(len(steady), 1)
    summary = {
        "steps": f"{start + len(times)}/{t.steps}" + (f" (resumed at {start})" if start else ""),
        "mesh": str(dims), "device": f"{world} × {device_type}",
        "first loss": losses[0] if losses else float("nan"),
        "final loss": losses[-1] if losses else float("nan"),
        "step time (s, excl. first)": mean_dt,
        "tokens/s (global)": tokens_per_step / mean_dt if mean_dt else 0.0,
        "tokens/s per device": tokens_per_step / mean_dt / world if mean_dt else 0.0,
        "MFU": GPU_ONLY if device_type != "cuda" else (
            "unknown GPU peak" if not peak else
            f"{flops_token * tokens_per_step / mean_dt / world / peak:.1%}"),
        "peak memory": GPU_ONLY if device_type != "cuda" else
        f"{torch.cuda.max_memory_allocated() / 2 ** 30:.2f} GiB",
        "run folder": str(prep.run_dir),
        "checkpoint": str(last_saved) if last_saved else "none",
    }
    reporter.close(summary)
    summary["losses"], summary["step_times"] = losses, times
    return summary


def _resume_step(prep: Prepared) -> int:
    if prep.resume_from is None:
        return 0
    return ckpt.read_trainer_state(prep.resume_from)["step"]


def _write_plan(prep: Prepared) -> None:
    import yaml

    with open(prep.run_dir / "plan.yaml", "w") as f:
        f.write(f"# resolved from {prep.plan.source}\n")
        yaml.safe_dump(prep.plan.to_dict(), f, sort_keys=False)


def _trim_metrics(run_dir: Path, keep_up_to: int) -> None:
    """A fresh run starts the metrics over; a resumed one drops rows past its checkpoint
    (a killed run may have logged steps it never saved), so the file is one curve."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return
    rows = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line)["step"] <= keep_up_to]
    path.write_text("".join(r + "\n" for r in rows))


def _batch_recorder(prep: Prepared, rank: int, dp_rank: int, tp_rank: int):
    if os.environ.get(RECORD_BATCHES_ENV) != "1":
        return lambda step, batch: None
    folder = prep.run_dir / "batches"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank{rank}.jsonl"

    def record(step: int, batch: torch.Tensor) -> None:
        digest = hashlib.sha256(batch.numpy().tobytes()).hexdigest()[:16]
        with open(path, "a") as out:
            out.write(json.dumps({"step": step, "dp_rank": dp_rank, "tp_rank": tp_rank,
                                  "digest": digest}) + "\n")
    return record
