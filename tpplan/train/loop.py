"""The training loop: a client of the public API (load, build_mesh, apply, loss_context).

Order: check everything (no process group yet) -> mesh -> claim the run folder and choose
an intact checkpoint (:mod:`.resume`) -> ``plan.apply`` on the meta model -> ``to_empty`` +
seeded init -> AdamW + warmup/cosine -> resume -> steps with gradient accumulation and
clipping -> DCP checkpoints. A non-finite loss or gradient norm stops the run before the
optimizer step; SIGTERM/SIGINT stops it after the step, with a checkpoint (:mod:`.signals`).
The loss is the mean over the global batch's counted targets (:mod:`.evaluate`).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .. import checkpoint as ckpt
from ..parallel.mesh import dp_rank as data_parallel_rank
from ..parallel.float8 import cuda_capability, float8_problems
from ..parallel.runtime import default_device_type
from . import hooks
from .data import Batch, document_positions
from .evaluate import Evaluation
from .failures import not_finite, out_of_memory, peer_cause, peer_lost
from .memwatch import StepMemory, largest_peak
from .optim import clip_grad_norm
from .profiling import StepProfiler
from .replicated import (checkpoint_writer, group_targets, hook_rank, join_replicas, lost_rank_hint, replica_fields,
                         share, step_numbers)
from .progress import Reporter, flops_per_token, peak_flops
from .resume import Claim, claim
from .runfolder import record_launch, start_folder
from .setup import Prepared, TrainError, prepare
from .signals import Preemption
from .sinks import Sinks
from .summary import Throughput, run_header, run_summary
from .trainee import Trainee, build_trainee, save_checkpoint
from .verdict import settle

__all__ = ["train"]


def train(plan_path: str, overrides: Sequence[str] = (), resume: str | None = None,
          overwrite: bool = False, device_type: str | None = None,
          estimate: Callable[[int, str], dict[str, Any]] | None = None) -> dict:
    """Run ``tpplan train`` in this process (one rank of torchrun, or a world of one).

    Raises :class:`~tpplan.plan.errors.PlanErrors` / :class:`~tpplan.train.setup.TrainError`
    for a mistake in the plan, the data or the run folder (before any collective where the
    mistake can be found alone), a damaged checkpoint, a failed save or a diverged loss --
    the same error on every rank. Returns the summary shown at the end, plus ``losses`` and
    ``step_times`` per step, and ``stopped`` (a signal name) when a signal ended it early.
    ``estimate(world_size, device_type)``: the dry run's figures, called on rank 0 before the
    process group starts and printed at the end next to what was measured (:mod:`.verdict`),
    unless the plan's ``metrics.dry_run`` is false.
    """
    _quiet_known_warnings()
    prep = prepare(plan_path, overrides, resume, overwrite)
    device_type = device_type or default_device_type()
    float8_problems(prep.plan.spec, device_type, *cuda_capability(device_type)).raise_if_any()
    owned = not dist.is_initialized()  # a caller's own process group is left running
    predicted = None
    if estimate is not None and prep.plan.spec.metrics.dry_run and owned and \
            int(os.environ.get("RANK", "0")) == 0:
        predicted = estimate(prep.dims.world_size, device_type)
    mesh = prep.plan.build_mesh(device_type)
    claimed: Claim | None = None
    try:
        claimed = claim(prep, prep.model)  # shapes of the model before it is parallelized
        return _run(prep, claimed, mesh, device_type, predicted)
    except ckpt.Damaged as e:
        raise TrainError(f"cannot resume: {e}") from None
    except RuntimeError as e:
        if (oom := out_of_memory(prep, e)) is not None:
            raise oom from None
        if not peer_lost(e):
            raise
        raise TrainError(f"rank {dist.get_rank()}: lost another rank, which crashed or was "
                         f"killed ({peer_cause(e)}); {lost_rank_hint()}",
                         every_rank=True) from None
    finally:
        prep.feed.close()
        if claimed is not None:
            claimed.lock.release()
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


@dataclass
class _Watchers:
    """What watches the steps and reports them."""
    reporter: Reporter
    sinks: Sinks
    profiler: StepProfiler
    memory: StepMemory
    record: Callable[[int, torch.Tensor], None]  # the batch record (a test hook, off by default)
    evaluation: Evaluation


@dataclass
class _Rank:
    """This rank's place in the run, read by every step."""
    device: torch.device
    device_type: str
    rank: int
    dp_rank: int
    pp_group: Any  # the pp process group, None without a pipeline
    shapes: dict[str, list[int]]  # the whole model's parameter shapes, saved with each checkpoint
    rate: Throughput
    replica: Any = None  # tpplan.ft.Replica in a fault-tolerant replica group, else None


@dataclass
class _Progress:
    """What the steps so far leave: their times and losses, the signal that stopped them (0:
    none) and the last checkpoint saved."""
    start: int
    last_saved: Path | None
    times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    stopped: int = 0


def _run(prep: Prepared, claimed: Claim, mesh, device_type: str,
         predicted: dict[str, Any] | None) -> dict:
    """This rank's run once the plan is checked: the run folder started, the model built, the
    steps, the summary."""
    plan, dims, t = prep.plan, prep.dims, prep.plan.train
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(device_type, torch.cuda.current_device()) \
        if device_type == "cuda" else torch.device(device_type)
    start = claimed.state["step"] if claimed.state else 0
    notes = start_folder(prep, claimed, start) if rank == 0 else []
    dist.barrier()

    shapes = ckpt.model_shapes(prep.model)  # the whole model's, on every pipeline degree
    n_params = sum(p.numel() for p in prep.model.parameters())
    trainee = build_trainee(prep, claimed, mesh, device)
    pp_group = mesh["pp"].get_group() if dims.pp > 1 else None
    local_params = sum(p.numel() for part in trainee.parts for p in part.parameters())

    dp_rank, tp_rank = data_parallel_rank(mesh), mesh["tp"].get_local_rank()
    tokens_per_step = prep.step.global_batch * t.seq_len
    peak = peak_flops(device_type)
    rate = Throughput(tokens_per_step, flops_per_token(prep.model, n_params, t.seq_len), peak, world)
    header = run_header(prep, claimed, start, notes, n_params, trainee, local_params, world, device_type)
    watch = _Watchers(
        Reporter(prep.run_dir, t.steps, start, rank == 0, header),
        Sinks(plan.metrics, prep.run_dir, rank == 0, plan.to_dict()),
        StepProfiler(plan.metrics.profile, prep.run_dir, rank, device_type, mesh),
        StepMemory(device_type),
        hooks.batch_recorder(prep.run_dir, rank, dp_rank, tp_rank),
        Evaluation(prep, trainee.parts[0], prep.step.micro_batch, dp_rank, device))  # no eval under pp
    replica = join_replicas(prep, trainee, device_type, watch.reporter, start)
    where = _Rank(device, device_type, rank, dp_rank, pp_group, shapes, rate, replica)
    progress = _Progress(start, claimed.resume_from)
    try:
        _steps(prep, trainee, watch, where, progress)
        if replica is not None:  # every rank done with the group's Manager before rank 0's stops
            dist.barrier()
    finally:
        if replica is not None:
            replica.close()
    return _finish(prep, watch, where, progress, predicted)


def _steps(prep: Prepared, trainee: Trainee, watch: _Watchers, where: _Rank, progress: _Progress) -> None:
    """The optimizer steps from ``progress.start`` on: each logged, checkpointed at the plan's
    interval and at the end; a signal agreed by every rank ends them after its step."""
    plan, t = prep.plan, prep.plan.train
    with Preemption(plan.checkpoint.on_signal) as preemption:
        for step in step_numbers(progress.start, t.steps, where.replica):
            watch.memory.before(trainee.parts, trainee.optimizers)
            t0 = time.perf_counter()
            with watch.profiler.step(step):
                global_batch, dp_rank, dp = share(prep, where.dp_rank, where.replica)
                batch = prep.feed.batch(step, dp_rank, dp, global_batch)
                watch.record(step, batch.tokens)
                updated = _update(prep, trainee, batch, step, where, watch.profiler, progress.last_saved)
                if updated is None:  # the replica groups did not commit: the step again
                    continue
                loss_value, grad_norm, lr, trained = updated
                if where.device_type == "cuda":
                    torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            watch.memory.after(step)
            if watch.profiler.done(step):
                watch.profiler.show(watch.reporter.note)
            progress.times.append(dt)
            progress.losses.append(loss_value)
            row = {"step": step, "loss": loss_value, "grad_norm": grad_norm, "lr": lr,
                   "step_time_s": dt, "tokens_per_s": where.rate.tokens_per_step / dt,
                   "tokens_per_s_per_device": where.rate.tokens_per_step / dt / where.rate.world}
            if batch.mask is not None:
                row["loss_tokens"] = batch.count
            row.update(watch.profiler.mark(step))
            row.update(replica_fields(where.replica, step, trained, step == t.steps))
            if where.device_type == "cuda":
                row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
                row["mfu"] = where.rate.mfu(dt) if where.rate.peak else None
            row.update(watch.evaluation.after(step))
            row.update(prep.feed.metrics(step, watch.reporter.note))
            watch.reporter.log(row, show=step % plan.metrics.log_interval == 0 or step == t.steps)
            watch.sinks.log(row)
            hooks.after_step(hook_rank(where.rank, where.rate.world, where.replica), step)
            progress.stopped = stopped = preemption.agreed(where.device)
            interval = plan.checkpoint.interval
            writer = checkpoint_writer(prep, where.replica)  # in replica groups: one group of the step
            if writer is not None and (stopped or step == t.steps or (interval and step % interval == 0)):
                progress.last_saved = save_checkpoint(
                    writer, trainee, step, Preemption.name(stopped) if stopped else "interval", where.shapes,
                    progress.last_saved)
            if stopped:
                break


def _update(prep: Prepared, trainee: Trainee, batch: Batch, step: int, where: _Rank, profiler: StepProfiler,
            last_saved: Path | None) -> tuple[float, float, float, int] | None:
    """One optimizer step on ``batch``: forward and backward over its micro-batches, the loss
    summed over the world, gradients clipped, then the update; a non-finite loss or gradient
    norm stops the run before the update. Returns the loss, the gradient norm, the lr and the
    targets trained; None when the replica groups did not commit it (:mod:`tpplan.ft`)."""
    plan, dims, t = prep.plan, prep.dims, prep.plan.train
    tokens, mask = batch.to(where.device)
    positions = (document_positions(tokens, prep.feed.separator) if batch.positions is None
                 else batch.positions.to(where.device)) if plan.data.document_mask else None
    count = max(batch.count, 1)  # a global batch of prompts only: loss 0, no update
    loss_sum = trainee.stepper(tokens, mask, count, positions)
    # TP peers hold the same partial sums (under a pipeline, the last stage's
    # ranks; the others hold 0): the world's total over tp is the global mean.
    with profiler.phase("loss"):
        dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
    loss_value, trained = loss_sum.item() / dims.tp, batch.count
    if where.replica is not None:  # the other groups' gradients and losses added
        reduced = where.replica.reduce(loss_value, group_targets(prep, batch, where.device), batch.count)
        loss_value, trained = reduced or (math.nan, 0)
    with profiler.phase("clip"):
        grad_norm = clip_grad_norm(trainee.trained, t.grad_clip, where.pp_group, trainee.ep_local)
    # every rank of the group asks (a collective); a failed all-reduce makes it False
    if where.replica is not None and not where.replica.commit():
        for optimizer in trainee.optimizers:
            optimizer.zero_grad(set_to_none=True)
        return None
    if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
        raise not_finite(step, loss_value, grad_norm, trainee.parts, trainee.optimizers, last_saved)
    lr = trainee.schedules[0].get_last_lr()[0]
    for optimizer, schedule in zip(trainee.optimizers, trainee.schedules):
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
    return loss_value, grad_norm, lr, trained


def _finish(prep: Prepared, watch: _Watchers, where: _Rank, progress: _Progress,
            predicted: dict[str, Any] | None) -> dict:
    """The summary after the last step (shown, recorded, compared with ``predicted`` on rank
    0), a note when a signal stopped the run, and the losses and step times."""
    plan, start, times, stopped = prep.plan, progress.start, progress.times, progress.stopped
    profiler, reporter = watch.profiler, watch.reporter
    if profiler.done(start + len(times), stopped=True):  # stopped inside the window
        profiler.show(reporter.note)
    steady = [dt for i, dt in enumerate(times[1:], start + 2) if not profiler.mark(i)] \
        or times[1:] or times
    mean_dt = sum(steady) / max(len(steady), 1)
    measured = largest_peak(watch.memory, where.device)
    summary = run_summary(prep, start, progress.losses, mean_dt, measured, where.rate, where.device_type,
                          watch.memory, watch.evaluation, watch.sinks, profiler, progress.last_saved)
    if where.rank == 0:
        summary.update(settle(prep.run_dir, predicted, measured, mean_dt, watch.memory, watch.sinks))
    reporter.close(summary)
    watch.sinks.close()
    if stopped:
        done = start + len(times)
        saved = (f"checkpoint saved at {progress.last_saved}; continue with --resume"
                 if plan.checkpoint.enabled else "checkpoints are off: nothing saved")
        reporter.note(f"tpplan train: stopped by {Preemption.name(stopped)} after step {done}; "
                      f"{saved}")
        summary["stopped"] = Preemption.name(stopped)
        if where.rank == 0:
            record_launch(prep.run_dir, stopped=summary["stopped"], step=done)
    summary["losses"], summary["step_times"] = progress.losses, times
    return summary
