"""The metric sinks of the ``metrics`` section (pure data; the trainer's ``train/sinks.py``
writes to them)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TensorBoardSpec", "WANDB_MODES", "WandbSpec"]


@dataclass
class TensorBoardSpec:
    """``metrics.tensorboard:`` — event files for TensorBoard, in ``dir`` (default
    ``<run_dir>/tensorboard``)."""

    dir: str | None = None


@dataclass
class WandbSpec:
    """``metrics.wandb:`` — a Weights & Biases run in ``project``; ``offline`` writes it under
    ``dir`` (default the run folder) for ``wandb sync`` later, ``online`` streams it."""

    project: str = "tpplan"
    mode: str = "offline"
    dir: str | None = None
    name: str | None = None  # default: the run folder's name


WANDB_MODES = ("offline", "online")
