"""The ``metrics`` section and its sinks (pure data; the trainer's ``train/sinks.py`` writes
to them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import Loc

__all__ = ["MetricsSpec", "TensorBoardSpec", "WANDB_MODES", "WandbSpec"]


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


@dataclass
class MetricsSpec:
    """``metrics:`` — the run folder, how often rank 0 reports, sinks, steps to profile, and
    whether rank 0 runs the dry run before the first step to print its figures beside the
    run's (``dry_run``)."""

    run_dir: str | None = None  # default runs/<plan file stem>
    log_interval: int = 1
    tensorboard: TensorBoardSpec | None = None
    wandb: WandbSpec | None = None
    profile: tuple[int, int] | None = None
    dry_run: bool = True
    loc: Loc | None = None
    locs: dict[str, Loc] = field(default_factory=dict)
