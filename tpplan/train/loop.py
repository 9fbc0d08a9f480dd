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
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .. import checkpoint as ckpt
from ..models import init_weights, materialize
from ..models.init import init_adapters
from ..parallel.experts.module_list import expert_list_groups
from ..parallel.mesh import dp_rank as data_parallel_rank
from ..parallel.runtime import default_device_type
from . import hooks
from .data import document_positions, step_batch
from .evaluate import Evaluation
from .failures import out_of_memory, peer_lost
from .memwatch import StepMemory, largest_peak
from .optim import clip_grad_norm, lr_lambda, make_optimizer, trained_summary
from .pretrained import load as load_pretrained
from .pretrained import load_adapter
from .profiling import StepProfiler
from .progress import GPU_ONLY, Reporter, flops_per_token, peak_flops
from .resume import Claim, claim
from .runfolder import record_launch, start_folder
from .setup import Prepared, TrainError, prepare
from .signals import Preemption
from .sinks import Sinks
from .verdict import settle
from .stepper import make_stepper

__all__ = ["train"]


def _init(parts: list, seed: int, device: torch.device) -> str:
    """Seeded init of each part: parameters are seeded by their whole-model name, so the
    numbers do not depend on the pipeline split."""
    return [init_weights(part, seed, device) for part in parts][0]


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
    process group starts and printed at the end next to what was measured (:mod:`.verdict`).
    """
    _quiet_known_warnings()
    prep = prepare(plan_path, overrides, resume, overwrite)
    device_type = device_type or default_device_type()
    owned = not dist.is_initialized()  # a caller's own process group is left running
    predicted = None
    if estimate is not None and owned and int(os.environ.get("RANK", "0")) == 0:
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
        first = str(e).strip().splitlines()[0]
        raise TrainError(f"rank {dist.get_rank()}: lost another rank, which crashed or was "
                         f"killed ({first[first.rfind(']') + 1:].strip()[:160]}); under torchrun "
                         f"--max-restarts the workers restart and resume from the last "
                         f"checkpoint", every_rank=True) from None
    finally:
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


def _run(prep: Prepared, claimed: Claim, mesh, device_type: str,
         predicted: dict[str, Any] | None) -> dict:
    plan, dims, t = prep.plan, prep.dims, prep.plan.train
    accum, micro_size = prep.step.grad_accum, prep.step.micro_batch
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(device_type, torch.cuda.current_device()) \
        if device_type == "cuda" else torch.device(device_type)
    start = claimed.state["step"] if claimed.state else 0
    notes = start_folder(prep, claimed, start) if rank == 0 else []
    dist.barrier()

    shapes = ckpt.model_shapes(prep.model)  # the whole model's, on every pipeline degree
    n_params = sum(p.numel() for p in prep.model.parameters())
    # FSDP2 averages gradients over dp ranks: scale them back to the global mean's (.evaluate)
    # FSDP2 averages over dp_shard × cp: each rank's loss is its tokens' part of the sum
    dp_scale = dims.dp * dims.cp if plan.fsdp is not None else 1
    stepper = make_stepper(plan, prep.model, mesh, device, micro_size, accum, dp_scale, dims.dp)
    parts = stepper.parts  # the model, or this rank's pipeline stages
    for part in parts:
        materialize(part, device)
    lora = plan.lora is not None  # checkpoints hold what trains; the base is loaded as at start
    if claimed.resume_from is not None and not (lora and prep.pretrained is not None):
        init_method = f"{_init(parts, t.seed, device)} init, then the checkpoint's"
    elif prep.pretrained is not None:
        init_method = load_pretrained(prep.pretrained, parts[0])
        if sum(init_adapters(part, t.seed) for part in parts):  # not in the HF folder
            init_method += ", LoRA adapters drawn"
    else:
        init_method = _init(parts, t.seed, device) + " init"
    if prep.adapter is not None and claimed.resume_from is None:
        load_adapter(prep.adapter, parts)
        init_method += f", LoRA adapters from {plan.model.adapter}"
    made = [make_optimizer(part, t) for part in parts]  # over what `freeze` leaves training
    optimizers = [o for o, _ in made]
    trained = [p for _, ps in made for p in ps]
    ep_local = expert_list_groups(parts)  # experts of a list: each on its ep rank only
    schedules = [torch.optim.lr_scheduler.LambdaLR(
        o, lambda s: lr_lambda(s, t.warmup_steps, t.steps, t.lr, t.min_lr)) for o in optimizers]
    if claimed.resume_from is not None:
        state = ckpt.load(claimed.resume_from, parts, optimizers, trained_only=lora)
        for schedule in schedules:
            schedule.load_state_dict(state["schedule"])
        torch.set_rng_state(state["rng"])
    pp_group = mesh["pp"].get_group() if dims.pp > 1 else None
    local_params = sum(p.numel() for part in parts for p in part.parameters())

    dp_rank, tp_rank = data_parallel_rank(mesh), mesh["tp"].get_local_rank()
    tokens_per_step = prep.step.global_batch * t.seq_len
    peak = peak_flops(device_type)
    flops_token = flops_per_token(prep.model, n_params, t.seq_len)
    header = (f"tpplan train: {plan.source} | {dims} on {world} {device_type} ranks | "
              f"{n_params / 1e6:.2f}M params{trained_summary(trained, local_params)} "
              f"({init_method}) | data {prep.corpus.source}, "
              f"{len(prep.corpus) / 1e6:.2f}M tokens | global batch {prep.step.global_batch}×"
              f"{t.seq_len} = {accum} micro-batch(es) of {micro_size} per dp rank | "
              f"run folder {prep.run_dir}")
    if prep.restarted:
        header += "\nrestarted by torchrun: " + (
            "continuing from the last checkpoint" if start else "no checkpoint yet, from step 0")
    if claimed.resume_from is not None:
        header += f"\nresumed from {claimed.resume_from} at step {start}"
    header += "".join(f"\n{n}" for n in notes)
    reporter = Reporter(prep.run_dir, t.steps, start, rank == 0, header)
    sinks = Sinks(plan.metrics, prep.run_dir, rank == 0, plan.to_dict())
    profiler = StepProfiler(plan.metrics.profile, prep.run_dir, rank, device_type, mesh)
    memory = StepMemory(device_type)
    record = hooks.batch_recorder(prep.run_dir, rank, dp_rank, tp_rank)
    evaluation = Evaluation(prep, parts[0], micro_size, dp_rank, device)  # no eval under pp
    times, losses, stopped = [], [], 0
    last_saved = claimed.resume_from

    def save(step: int, reason: str) -> Path:
        state = {"step": step, "schedule": schedules[0].state_dict(), "data_step": step,
                 "rng": torch.get_rng_state(), "model_shapes": shapes,
                 "mesh": dims.as_dict(), "plan": plan.source, "reason": reason}
        if lora:
            state["lora_base"] = prep.lora_base
        try:
            return ckpt.save(prep.ckpt_dir, step, parts, optimizers, state, plan.checkpoint.keep,
                             trained_only=lora)
        except ckpt.SaveFailed as e:
            kept = f"the previous checkpoint {last_saved} is intact" if last_saved else \
                "no earlier checkpoint exists"
            raise TrainError(f"{e}; {kept}") from None

    with Preemption(plan.checkpoint.on_signal) as preemption:
        for step in range(start + 1, t.steps + 1):
            memory.before(parts, optimizers)
            t0 = time.perf_counter()
            with profiler.step(step):
                batch = step_batch(prep.corpus, t.seed, step, prep.step.global_batch,
                                   t.seq_len, dp_rank, dims.dp)
                record(step, batch.tokens)
                tokens, mask = batch.to(device)
                positions = document_positions(tokens, prep.corpus.separator) \
                    if plan.data.document_mask else None
                count = max(batch.count, 1)  # a global batch of prompts only: loss 0, no update
                loss_sum = stepper(tokens, mask, count, positions)
                # TP peers hold the same partial sums (under a pipeline, the last stage's
                # ranks; the others hold 0): the world's total over tp is the global mean.
                with profiler.phase("loss"):
                    dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
                loss_value = loss_sum.item() / dims.tp
                with profiler.phase("clip"):
                    grad_norm = clip_grad_norm(trained, t.grad_clip, pp_group, ep_local)
                if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
                    raise TrainError(
                        f"step {step}: loss {loss_value}, gradient norm {grad_norm}: training "
                        f"diverged; stopped before the optimizer step (last checkpoint: "
                        f"{last_saved or 'none'}). Lower train.lr or set train.grad_clip")
                lr = schedules[0].get_last_lr()[0]
                for optimizer, schedule in zip(optimizers, schedules):
                    optimizer.step()
                    schedule.step()
                    optimizer.zero_grad(set_to_none=True)
                if device_type == "cuda":
                    torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            memory.after(step)
            if profiler.done(step):
                profiler.show(reporter.note)
            times.append(dt)
            losses.append(loss_value)
            row = {"step": step, "loss": loss_value, "grad_norm": grad_norm, "lr": lr,
                   "step_time_s": dt, "tokens_per_s": tokens_per_step / dt,
                   "tokens_per_s_per_device": tokens_per_step / dt / world}
            if batch.mask is not None:
                row["loss_tokens"] = batch.count
            row.update(profiler.mark(step))
            if device_type == "cuda":
                row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
                row["mfu"] = flops_token * tokens_per_step / dt / world / peak if peak else None
            row.update(evaluation.after(step))
            reporter.log(row, show=step % plan.metrics.log_interval == 0 or step == t.steps)
            sinks.log(row)
            hooks.after_step(rank, step)
            stopped = preemption.agreed(device)
            interval = plan.checkpoint.interval
            if plan.checkpoint.enabled and (stopped or step == t.steps
                                            or (interval and step % interval == 0)):
                last_saved = save(step, Preemption.name(stopped) if stopped else "interval")
            if stopped:
                break

    if profiler.done(start + len(times), stopped=True):  # stopped inside the window
        profiler.show(reporter.note)
    steady = [dt for i, dt in enumerate(times[1:], start + 2) if not profiler.mark(i)] \
        or times[1:] or times
    mean_dt = sum(steady) / max(len(steady), 1)
    measured = largest_peak(memory, device)
    summary = {
        "steps": f"{start + len(times)}/{t.steps}" + (f" (resumed at {start})" if start else ""),
        "mesh": str(dims), "device": f"{world} × {device_type}",
        "first loss": losses[0] if losses else float("nan"),
        "final loss": losses[-1] if losses else float("nan"),
        **evaluation.summary(),
        f"step time (s, excl. first{' and profiled' * bool(plan.metrics.profile)})": mean_dt,
        "tokens/s (global)": tokens_per_step / mean_dt if mean_dt else 0.0,
        "tokens/s per device": tokens_per_step / mean_dt / world if mean_dt else 0.0,
        "MFU": GPU_ONLY if device_type != "cuda" else (
            "unknown GPU peak" if not peak else
            f"{flops_token * tokens_per_step / mean_dt / world / peak:.1%}"),
        "peak memory": f"{measured / 2 ** 20:,.1f} MiB ({memory.how}, largest rank)"
        if measured is not None else "not measured on this system (Linux with glibc, or CUDA)",
        "run folder": str(prep.run_dir),
        "metrics": str(prep.run_dir / "metrics.jsonl"),
        **sinks.where,
        **({"profile": f"{profiler.folder} (trace-rank<R>.json: open in ui.perfetto.dev)"}
           if plan.metrics.profile else {}),
        "checkpoint": str(last_saved) if last_saved else "none",
    }
    if rank == 0:
        summary.update(settle(prep.run_dir, predicted, measured, mean_dt, memory, sinks))
    reporter.close(summary)
    sinks.close()
    if stopped:
        done = start + len(times)
        where = (f"checkpoint saved at {last_saved}; continue with --resume"
                 if plan.checkpoint.enabled else "checkpoints are off: nothing saved")
        reporter.note(f"tpplan train: stopped by {Preemption.name(stopped)} after step {done}; "
                      f"{where}")
        summary["stopped"] = Preemption.name(stopped)
        if rank == 0:
            record_launch(prep.run_dir, stopped=summary["stopped"], step=done)
    summary["losses"], summary["step_times"] = losses, times
    return summary

