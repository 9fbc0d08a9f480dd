"""What a run says about itself: the header printed before its first step and the summary
table after its last, with the throughput figures a step's time is read against.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .evaluate import Evaluation
from .memwatch import StepMemory
from .optim import trained_summary
from .profiling import StepProfiler
from .progress import GPU_ONLY
from .resume import Claim
from .setup import Prepared
from .sinks import Sinks
from .trainee import Trainee

__all__ = ["Throughput", "run_header", "run_summary"]


@dataclass(frozen=True)
class Throughput:
    """Tokens per optimizer step over the whole world, the model's FLOPs per token, the
    device's peak FLOP/s (``None``: unknown) and the ranks: a step time's tokens/s and MFU."""
    tokens_per_step: int
    flops_token: float
    peak: float | None
    world: int

    def mfu(self, dt: float) -> float:
        """Model FLOPs utilization of a step of ``dt`` seconds (needs ``peak``)."""
        return self.flops_token * self.tokens_per_step / dt / self.world / self.peak


def run_header(prep: Prepared, claimed: Claim, start: int, notes: list[str], n_params: int,
               trainee: Trainee, local_params: int, world: int, device_type: str) -> str:
    """The lines printed before the first step: plan, mesh, model, data, batch, run folder,
    and how this launch began (restarted, resumed) with rank 0's notes."""
    plan, dims, t = prep.plan, prep.dims, prep.plan.train
    header = (f"tpplan train: {plan.source} | {dims} on {world} {device_type} ranks | "
              f"{n_params / 1e6:.2f}M params{trained_summary(trainee.trained, local_params)} "
              f"({trainee.init_method}) | data {prep.feed.source}, "
              f"{len(prep.feed) / 1e6:.2f}M tokens | global batch {prep.step.global_batch}×"
              f"{t.seq_len} = {prep.step.grad_accum} micro-batch(es) of {prep.step.micro_batch} per dp rank | "
              f"run folder {prep.run_dir}")
    if prep.restarted:
        header += "\nrestarted by torchrun: " + (
            "continuing from the last checkpoint" if start else "no checkpoint yet, from step 0")
    if claimed.resume_from is not None:
        header += f"\nresumed from {claimed.resume_from} at step {start}"
    return header + "".join(f"\n{n}" for n in notes)


def run_summary(prep: Prepared, start: int, losses: list[float], mean_dt: float, measured: int | None,
                rate: Throughput, device_type: str, memory: StepMemory, evaluation: Evaluation,
                sinks: Sinks, profiler: StepProfiler, last_saved: Path | None) -> dict[str, Any]:
    """The table shown at the end: steps, losses, the steady step time (``mean_dt``) and what
    follows from it, the largest rank's ``measured`` peak memory, and where everything went."""
    plan, t, world = prep.plan, prep.plan.train, rate.world
    return {
        "steps": f"{start + len(losses)}/{t.steps}" + (f" (resumed at {start})" if start else ""),
        "mesh": str(prep.dims), "device": f"{world} × {device_type}",
        "first loss": losses[0] if losses else float("nan"),
        "final loss": losses[-1] if losses else float("nan"),
        **evaluation.summary(),
        **prep.feed.summary(start + len(losses)),
        f"step time (s, excl. first{' and profiled' * bool(plan.metrics.profile)})": mean_dt,
        "tokens/s (global)": rate.tokens_per_step / mean_dt if mean_dt else 0.0,
        "tokens/s per device": rate.tokens_per_step / mean_dt / world if mean_dt else 0.0,
        "MFU": GPU_ONLY if device_type != "cuda" else (
            "unknown GPU peak" if not rate.peak else f"{rate.mfu(mean_dt):.1%}"),
        "peak memory": f"{measured / 2 ** 20:,.1f} MiB ({memory.how}, largest rank)"
        if measured is not None else "not measured on this system (Linux with glibc, or CUDA)",
        "run folder": str(prep.run_dir),
        "metrics": str(prep.run_dir / "metrics.jsonl"),
        **sinks.where,
        **({"profile": f"{profiler.folder} (trace-rank<R>.json: open in ui.perfetto.dev)"}
           if plan.metrics.profile else {}),
        "checkpoint": str(last_saved) if last_saved else "none",
    }
