"""What the user sees on rank 0, and the metrics every run keeps.

On a terminal: a rich progress bar with step, loss, grad norm, lr and tokens/s (with an
``eval`` section, the validation loss and perplexity on the steps it runs; on GPU, MFU and
peak memory) and the time left. Not on a terminal (CI logs, pipes): one plain line per log
step, ending with the time left (``eta``: the steps to go at the mean step time so far, the
first step left out). Always: ``metrics.jsonl`` in the run folder and a summary table at
the end, which says where the metrics, the sinks' files, traces and checkpoints are.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from .runfolder import trim_metrics

__all__ = ["GPU_ONLY", "Reporter", "flops_per_token", "peak_flops"]

GPU_ONLY = "n/a on CPU (GPU only)"

# Dense bf16 peak (no sparsity) per device, for MFU; unknown devices report no MFU.
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}


def peak_flops(device_type: str) -> float | None:
    if device_type != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def flops_per_token(model: nn.Module, n_params: int, seq_len: int) -> float:
    # 6N for the matmuls forward+backward, plus attention's 12·L·d·s (PaLM appendix B).
    cfg = getattr(model, "config", None)
    attn = 12 * cfg.n_layers * cfg.dim * seq_len if cfg is not None and hasattr(cfg, "dim") else 0
    return 6 * n_params + attn


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:,.0f}"
    return str(v)


class Reporter:
    """Rank 0's display and metrics file; every method is a no-op on other ranks."""

    def __init__(self, run_dir: Path, total_steps: int, start_step: int, active: bool,
                 header: str, console: Console | None = None):
        self.active, self.total = active, total_steps
        self.rows: list[dict[str, Any]] = []
        if not active:
            return
        self.console = console or Console(stderr=False)
        if not self.console.is_terminal:
            self.console.width = 160  # CI logs: one line per step, never wrapped at 80
        # Kept open for the run and flushed per row: a killed run keeps what it logged.
        self.run_dir = run_dir
        self.metrics = open(run_dir / "metrics.jsonl", "a")  # noqa: SIM115
        self.console.print(header, soft_wrap=True, highlight=False)
        self.progress = None
        if self.console.is_terminal:
            self.progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"), TimeRemainingColumn(), console=self.console)
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step,
                                               info="")
            self.progress.start()

    def log(self, row: dict[str, Any], show: bool) -> None:
        if not self.active:
            return
        self.rows.append(row)
        self.metrics.write(json.dumps(row) + "\n")
        self.metrics.flush()
        info = (f"loss {row['loss']:.4f}  gnorm {row['grad_norm']:.3g}  lr {row['lr']:.3g}  "
                f"{row['tokens_per_s']:,.0f} tok/s ({row['tokens_per_s_per_device']:,.0f}/dev)")
        if "eval_loss" in row:
            info += f"  val {row['eval_loss']:.4f} (ppl {row['eval_ppl']:.4g})"
        if "replicas" in row:  # fault tolerance: the replica groups this step took part
            info += f"  replicas {row['replicas']}"
        if row.get("mfu") is not None:
            info += f"  mfu {row['mfu']:.1%}  mem {row['peak_mem_gib']:.1f} GiB"
        if self.progress is not None:
            self.progress.update(self.task, completed=row["step"], info=info)
        elif show:
            self.console.print(f"step {row['step']:>6}  {info}  eta {self.eta(row['step'])}",
                               highlight=False)

    def rewind(self, step: int) -> None:
        """Drop the rows past ``step`` from ``metrics.jsonl`` and the ETA's: steps this run
        trains again (a replica group that took a newer checkpoint, :mod:`.replicated`)."""
        if not self.active:
            return
        self.metrics.close()
        trim_metrics(self.run_dir, step)
        self.metrics = open(self.run_dir / "metrics.jsonl", "a")  # noqa: SIM115
        self.rows = [r for r in self.rows if r["step"] <= step]

    def eta(self, step: int) -> str:
        """The time left: the steps to go at the mean step time of this run's steps so far
        (its first, which pays for warm-up, left out when there are others)."""
        times = [r["step_time_s"] for r in self.rows if "step_time_s" in r]
        times = times[1:] or times
        left = max(self.total - step, 0) * (sum(times) / len(times) if times else 0.0)
        m, sec = divmod(int(round(left)), 60)
        h, m = divmod(m, 60)
        return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"

    def note(self, text: str) -> None:
        if self.active:  # one line however long its paths: tools and people grep for it
            (self.progress.console if self.progress else self.console).print(
                text, soft_wrap=True, highlight=False)

    def close(self, summary: dict[str, Any]) -> None:
        if not self.active:
            return
        if self.progress is not None:
            self.progress.stop()
        self.metrics.close()
        table = Table(title="tpplan train: summary", show_header=False)
        table.add_column("", style="bold")
        table.add_column("")
        for k, v in summary.items():
            table.add_row(k, _fmt(v))
        self.console.print(table)
