"""The trainer's sections of a plan (``train``, ``data``, ``checkpoint``, ``metrics``).

Read with the same located reader as the rest of the plan: an unknown key or a wrong
type is a ``file:line:col`` error with the nearest valid name, before any process group
exists. Every rank parses the same plan, so every rank fails the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ErrorList, Loc
from ..schema import _Reader
from ..yamlio import LSeq

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "MetricsConfig",
    "RunConfig",
    "TrainConfig",
    "parse_run_config",
]

NUMBER = (int, float)


@dataclass
class TrainConfig:
    """``train:`` — the optimization. Batch sizes count sequences of ``seq_len`` tokens."""

    steps: int = 100
    seq_len: int = 256
    global_batch_size: int = 8  # sequences per optimizer step, over all data-parallel ranks
    micro_batch_size: int | None = None  # per data-parallel rank per forward; None = no accum
    seed: int = 0
    lr: float = 3e-4
    min_lr: float = 0.0  # the cosine ends here
    warmup_steps: int = 0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float | None = 1.0  # max global L2 norm; null = no clipping
    locs: dict[str, Loc] = field(default_factory=dict)


@dataclass
class DataConfig:
    """``data:`` — null ``path`` reads the Python standard library's own sources."""

    path: str | None = None
    max_bytes: int = 4_000_000  # cap on the text read (the stdlib default stays fast)
    locs: dict[str, Loc] = field(default_factory=dict)


@dataclass
class CheckpointConfig:
    """``checkpoint:`` — DCP checkpoints in ``<run_dir>/checkpoints`` unless ``dir`` is set."""

    enabled: bool = True
    interval: int = 0  # every N steps; 0 = only at the end
    keep: int = 2  # complete checkpoints kept (older ones deleted); 0 = keep all
    dir: str | None = None
    locs: dict[str, Loc] = field(default_factory=dict)


@dataclass
class MetricsConfig:
    """``metrics:`` — where the run folder is and how often rank 0 reports."""

    run_dir: str | None = None  # default runs/<plan file stem>
    log_interval: int = 1
    locs: dict[str, Loc] = field(default_factory=dict)


@dataclass
class RunConfig:
    train: TrainConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    metrics: MetricsConfig


def _num(r: _Reader, key: str, default: Any) -> Any:
    v = r.get(key, NUMBER, default, "a number")
    return float(v) if v is not None else v


def _positive(errs: ErrorList, r: _Reader, section: str, key: str, value: Any,
              low: float = 1) -> None:
    if value is not None and value < low:
        errs.add(f"'{section}.{key}' must be at least {low}, got {value}", r.loc(key))


def _train(plan, errs: ErrorList) -> TrainConfig:
    d = TrainConfig()
    m = plan.section("train")
    r = _Reader(errs, "train", m, m.loc, tuple(k for k in TrainConfig.__dataclass_fields__
                                               if k != "locs"))
    c = TrainConfig(
        steps=r.get("steps", int, d.steps), seq_len=r.get("seq_len", int, d.seq_len),
        global_batch_size=r.get("global_batch_size", int, d.global_batch_size),
        micro_batch_size=r.get("micro_batch_size", int, d.micro_batch_size),
        seed=r.get("seed", int, d.seed), lr=_num(r, "lr", d.lr), min_lr=_num(r, "min_lr", d.min_lr),
        warmup_steps=r.get("warmup_steps", int, d.warmup_steps), eps=_num(r, "eps", d.eps),
        weight_decay=_num(r, "weight_decay", d.weight_decay),
        grad_clip=_num(r, "grad_clip", d.grad_clip) if "grad_clip" in r.m else d.grad_clip,
        locs={k: r.loc(k) for k in r.m},
    )
    betas = r.m.get("betas")
    if betas is not None:
        if (isinstance(betas, LSeq) and len(betas) == 2
                and all(isinstance(b, NUMBER) and not isinstance(b, bool) for b in betas)):
            c.betas = (float(betas[0]), float(betas[1]))
        else:
            errs.add(f"'train.betas' must be a list of two numbers, got {betas!r}", r.loc("betas"))
    for key in ("steps", "seq_len", "global_batch_size", "micro_batch_size"):
        _positive(errs, r, "train", key, getattr(c, key))
    for key in ("warmup_steps", "weight_decay", "min_lr"):
        _positive(errs, r, "train", key, getattr(c, key), 0)
    if c.lr <= 0:
        errs.add(f"'train.lr' must be positive, got {c.lr}", r.loc("lr"))
    if c.grad_clip is not None and c.grad_clip <= 0:
        errs.add(f"'train.grad_clip' must be positive or null, got {c.grad_clip}",
                 r.loc("grad_clip"))
    return c


def _data(plan, errs: ErrorList) -> DataConfig:
    d = DataConfig()
    m = plan.section("data")
    r = _Reader(errs, "data", m, m.loc, ("path", "max_bytes"))
    c = DataConfig(path=r.get("path", str, None), max_bytes=r.get("max_bytes", int, d.max_bytes),
                   locs={k: r.loc(k) for k in r.m})
    _positive(errs, r, "data", "max_bytes", c.max_bytes)
    if c.path is not None and not Path(c.path).exists():
        errs.add(f"data.path '{c.path}' does not exist (a text file, a folder of text files, "
                 f"or a .bin of uint16 tokens; null = the Python standard library)", r.loc("path"))
    return c


def _checkpoint(plan, errs: ErrorList) -> CheckpointConfig:
    d = CheckpointConfig()
    m = plan.section("checkpoint")
    r = _Reader(errs, "checkpoint", m, m.loc, ("enabled", "interval", "keep", "dir"))
    c = CheckpointConfig(enabled=r.get("enabled", bool, d.enabled),
                         interval=r.get("interval", int, d.interval),
                         keep=r.get("keep", int, d.keep), dir=r.get("dir", str, None),
                         locs={k: r.loc(k) for k in r.m})
    for key in ("interval", "keep"):
        _positive(errs, r, "checkpoint", key, getattr(c, key), 0)
    return c


def _metrics(plan, errs: ErrorList) -> MetricsConfig:
    d = MetricsConfig()
    m = plan.section("metrics")
    r = _Reader(errs, "metrics", m, m.loc, ("run_dir", "log_interval"))
    c = MetricsConfig(run_dir=r.get("run_dir", str, None),
                      log_interval=r.get("log_interval", int, d.log_interval),
                      locs={k: r.loc(k) for k in r.m})
    _positive(errs, r, "metrics", "log_interval", c.log_interval)
    return c


def parse_run_config(plan, errs: ErrorList) -> RunConfig:
    """All four trainer sections; mistakes go to ``errs`` (raise with ``errs.raise_if_any``)."""
    return RunConfig(_train(plan, errs), _data(plan, errs), _checkpoint(plan, errs),
                     _metrics(plan, errs))
