"""Metric sinks beside ``metrics.jsonl``: TensorBoard and Weights & Biases, on rank 0 only.

Each logged row of ``metrics.jsonl`` goes to every sink the plan's ``metrics`` section turns
on, under the tags in :data:`TAGS` (the same numbers, the same steps). The resolved plan is
the run's config (W&B) and a text entry (TensorBoard), and so is the dry run's summary when
the command has one. A sink whose package is missing is one line naming the extra to install,
said before the process group starts (:func:`missing`).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["EVENTS", "Sinks", "TAGS", "missing", "tag"]

# metrics.jsonl key -> the tag a sink shows it under (grouped as TensorBoard and W&B panels).
TAGS = {
    "loss": "train/loss", "grad_norm": "train/grad_norm", "lr": "train/lr",
    "loss_tokens": "train/loss_tokens", "eval_loss": "eval/loss", "eval_ppl": "eval/perplexity",
    "step_time_s": "perf/step_time_s", "tokens_per_s": "perf/tokens_per_s",
    "tokens_per_s_per_device": "perf/tokens_per_s_per_device", "mfu": "perf/mfu",
    "peak_mem_gib": "memory/peak_gib",
}
EVENTS = "events"  # the tag prefix of a row's event (fault tolerance: fault, rejoin, recovered)
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}


def tag(key: str) -> str:
    return TAGS.get(key, f"train/{key}")


def missing(metrics) -> str | None:
    """One line for the first sink the plan turns on whose package is not installed."""
    for name, (module, extra) in PACKAGES.items():
        if getattr(metrics, name) is not None and importlib.util.find_spec(module) is None:
            return (f"metrics.{name} needs the '{module}' package: pip install "
                    f"'tpplan[{extra}]' (or remove metrics.{name} from the plan)")
    return None


def _numbers(row: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in row.items() if k != "step" and isinstance(v, (int, float))
            and not isinstance(v, bool) and v == v}


class Sinks:
    """The sinks of one run on rank 0 (nothing elsewhere): ``log`` a row, ``text`` a note,
    ``close`` at the end. ``where`` names each sink's folder for the summary table."""

    def __init__(self, metrics, run_dir: Path, active: bool, config: dict[str, Any]):
        self.tb = self.wandb = None
        self.where: dict[str, str] = {}
        if not active:
            return
        if metrics.tensorboard is not None:
            from torch.utils.tensorboard import SummaryWriter

            folder = Path(metrics.tensorboard.dir or run_dir / "tensorboard")
            self.tb = SummaryWriter(log_dir=str(folder))
            self.tb.add_text("plan", "```yaml\n" + _yaml(config) + "```", 0)
            self.where["tensorboard"] = f"tensorboard --logdir {folder}"
        if metrics.wandb is not None:
            import wandb

            w = metrics.wandb
            folder = Path(w.dir or run_dir)
            folder.mkdir(parents=True, exist_ok=True)
            try:
                self.wandb = wandb.init(project=w.project, mode=w.mode, dir=str(folder),
                                        name=w.name or run_dir.resolve().name,
                                        config={"plan": config},
                                        settings=wandb.Settings(silent=True, console="off"))
            except Exception as e:  # noqa: BLE001 -- W&B down or not logged in: train anyway
                first = (str(e).strip().splitlines() or [""])[0][:200]
                self.where["wandb"] = f"not started ({type(e).__name__}: {first})"
                print(f"tpplan train: metrics.wandb: {self.where['wandb']}; training goes on, "
                      f"metrics.jsonl has every figure", file=sys.stderr, flush=True)
                return
            self.where["wandb"] = (f"{self.wandb.dir.removesuffix('/files')} (wandb sync it)"
                                   if w.mode == "offline" else self.wandb.url or w.project)

    def log(self, row: dict[str, Any]) -> None:
        """A row's numbers as scalars; its ``event`` (a fault tolerance group's fault, rejoin or
        recovery) also as ``events/<event>`` = 1 at that step, a mark on the same axis as the
        curves, and in TensorBoard as a text ``events`` of that step."""
        values = {tag(k): v for k, v in _numbers(row).items()}
        event = row.get("event")
        if isinstance(event, str):
            values[f"{EVENTS}/{event}"] = 1.0
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, row["step"])
            if isinstance(event, str):
                self.tb.add_text(EVENTS, f"step {row['step']}: {event}", row["step"])
        if self.wandb is not None:
            self.wandb.log(values, step=row["step"])

    def text(self, name: str, text: str, data: dict[str, Any] | None = None) -> None:
        """A note for the whole run (the dry run against the run); ``data`` also goes to the
        W&B config under ``name``."""
        if self.tb is not None:
            self.tb.add_text(name, text, 0)
        if self.wandb is not None:
            self.wandb.config.update({name: data if data is not None else text},
                                     allow_val_change=True)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        self.tb = self.wandb = None


def _yaml(data: dict[str, Any]) -> str:
    try:
        import yaml

        return yaml.safe_dump(data, sort_keys=False)
    except Exception:  # noqa: BLE001 -- a config that is not YAML is still shown
        return json.dumps(data, indent=1) + "\n"
