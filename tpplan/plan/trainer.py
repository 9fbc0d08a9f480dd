"""The trainer's sections of a plan: ``train``, ``data``, ``eval``, ``checkpoint``, ``metrics``.

Parsed with every other section when a plan is loaded, so ``tpplan validate`` rejects
exactly the keys and values ``tpplan train`` would: an unknown key, a boolean where a number
is meant, a value out of range — each a ``file:line:col`` error before any process group.
Checks that need the machine (does ``data.path`` exist?) are the trainer's own preflight.
"""

from __future__ import annotations

import math
from pathlib import Path

from .errors import ErrorList, nearest
from .reader import NUMBER, Reader, describe
from .sinks import WANDB_MODES, TensorBoardSpec, WandbSpec
from .specs import (DATA_FORMATS, TOKEN_DTYPES, CheckpointSpec, DataSpec, EvalSpec, MetricsSpec, SourceSpec,
                    TrainSpec)
from .yamlio import LMap, LSeq

__all__ = ["TRAINER_SECTIONS", "parse_checkpoint", "parse_data", "parse_eval", "parse_metrics",
           "parse_train"]

TRAINER_SECTIONS = ("train", "data", "eval", "checkpoint", "metrics")


def _fields(cls: type) -> tuple[str, ...]:
    return tuple(k for k in cls.__dataclass_fields__ if k not in ("loc", "locs"))


def _finite(r: Reader, key: str, value: float | None) -> None:
    if value is not None and not math.isfinite(value):
        r.errs.add(f"'{r.where}.{key}' must be a finite number, got {value}", r.loc(key))


def parse_train(doc: LMap, errs: ErrorList) -> TrainSpec:
    d = TrainSpec()
    r = Reader.section(errs, doc, "train", _fields(TrainSpec))
    spec = TrainSpec(
        steps=r.get("steps", int, d.steps), seq_len=r.get("seq_len", int, d.seq_len),
        # local_batch_size alone: the global batch follows from the mesh (local × dp).
        global_batch_size=r.get("global_batch_size", int, None if "local_batch_size" in r.m
                                else d.global_batch_size),
        local_batch_size=r.get("local_batch_size", int, None),
        micro_batch_size=r.get("micro_batch_size", int, d.micro_batch_size),
        seed=r.get("seed", int, d.seed), lr=r.number("lr", d.lr), min_lr=r.number("min_lr", d.min_lr),
        warmup_steps=r.get("warmup_steps", int, d.warmup_steps), eps=r.number("eps", d.eps),
        weight_decay=r.number("weight_decay", d.weight_decay),
        # null is a value here: no clipping
        grad_clip=r.number("grad_clip", d.grad_clip) if "grad_clip" in r.m else d.grad_clip,
        loss_chunk=r.get("loss_chunk", int, d.loss_chunk),
        loc=r.m.loc, locs=r.locs(),
    )
    betas = r.m.get("betas")
    if betas is not None:
        if (isinstance(betas, LSeq) and len(betas) == 2
                and all(isinstance(b, NUMBER) and not isinstance(b, bool) for b in betas)):
            spec.betas = (float(betas[0]), float(betas[1]))
            for i, b in enumerate(spec.betas):
                if not 0 <= b < 1:  # also nan and inf
                    errs.add(f"'train.betas' must each be in [0, 1) (AdamW's moment decay), got "
                             f"{b} as beta{i + 1}", betas.item_loc(i))
        else:
            errs.add(f"'train.betas' must be a list of two numbers, got {betas!r}", r.loc("betas"))
    for key in ("steps", "seq_len", "global_batch_size", "local_batch_size", "micro_batch_size"):
        r.at_least(key, getattr(spec, key), 1)
    for key in ("warmup_steps", "weight_decay", "min_lr", "loss_chunk"):
        r.at_least(key, getattr(spec, key), 0)
    for key in ("lr", "min_lr", "eps", "weight_decay", "grad_clip"):
        _finite(r, key, getattr(spec, key))
    for key in ("lr", "eps"):
        if getattr(spec, key) <= 0:
            errs.add(f"'train.{key}' must be positive, got {getattr(spec, key)}", r.loc(key))
    if spec.grad_clip is not None and spec.grad_clip <= 0:
        errs.add(f"'train.grad_clip' must be positive or null, got {spec.grad_clip}",
                 r.loc("grad_clip"))
    _schedule(r, spec)
    return spec


def _schedule(r: Reader, spec: TrainSpec) -> None:
    """Settings each valid alone that together make the run meaningless."""
    if spec.lr > 0 and spec.min_lr > spec.lr:
        r.errs.add(f"'train.min_lr' ({spec.min_lr}) is above 'train.lr' ({spec.lr}): the cosine "
                   "would raise the learning rate instead of decaying it", r.loc("min_lr"))
    decay = spec.lr * spec.weight_decay
    if math.isfinite(decay) and decay >= 1:
        where = "weight_decay" if "weight_decay" in r.m else "lr"
        r.errs.add(f"'train.lr' × 'train.weight_decay' = {spec.lr} × {spec.weight_decay} = "
                   f"{decay:g}, at least 1: AdamW's decoupled decay (w -= lr·wd·w) would zero or "
                   "flip every weight each step", r.loc(where))


def parse_data(doc: LMap, errs: ErrorList) -> DataSpec:
    d = DataSpec()
    r = Reader.section(errs, doc, "data", _fields(DataSpec))
    spec = DataSpec(path=r.get("path", str, None), max_bytes=r.get("max_bytes", int, d.max_bytes),
                    dtype=_token_dtype(r, "dtype", r.get("dtype", str, None)), sources=_sources(r),
                    tokenizer=r.get("tokenizer", str, None), format=r.get("format", str, d.format),
                    text_field=r.get("text_field", str, d.text_field),
                    separator=r.get("separator", str, None), workers=r.get("workers", int, None),
                    document_mask=r.get("document_mask", bool, True),
                    base_dir=str(Path(doc.loc.file).parent), loc=r.m.loc, locs=r.locs())
    r.at_least("max_bytes", spec.max_bytes, 1)
    r.at_least("workers", spec.workers, 1)
    if spec.format not in DATA_FORMATS:
        errs.add(f"'data.format' must be one of {', '.join(DATA_FORMATS)}, got "
                 f"'{spec.format}'{nearest(spec.format, DATA_FORMATS)}", r.loc("format"))
        spec.format = d.format
    if spec.sources and spec.path is not None:
        errs.add("'data' takes 'path' (one source) or 'sources' (a mixture), not both", r.loc("sources"))
    if spec.tokenizer is None:
        needs = [k for k in ("format", "separator", "text_field", "workers") if k in r.m
                 and not (k == "format" and spec.format in ("auto", "text"))]
        for key in needs:
            errs.add(f"'data.{key}' needs 'data.tokenizer' (without one the data is read as "
                     f"bytes)", r.loc(key))
    return spec


def _token_dtype(r: Reader, key: str, value: str | None) -> str | None:
    if value is not None and value not in TOKEN_DTYPES:
        r.errs.add(f"'{r.where}.{key}' must be one of {', '.join(TOKEN_DTYPES)} (the ids of a flat token "
                   f"file), got '{value}'{nearest(value, TOKEN_DTYPES)}", r.loc(key))
        return None
    return value


def _sources(r: Reader) -> list[SourceSpec]:
    """``data.sources``: a list of {path, weight, dtype}; weights non-negative, not all zero."""
    value = r.m.get("sources")
    if value is None:
        return []
    if not isinstance(value, LSeq) or not value:
        r.errs.add(f"'data.sources' must be a non-empty list of {{path, weight}}, got {describe(value)}",
                   r.loc("sources"))
        return []
    out = []
    for i, item in enumerate(value):
        s = Reader(r.errs, f"data.sources[{i}]", item, value.item_loc(i), _fields(SourceSpec))
        path = s.get("path", str, None)
        if path is None:
            r.errs.add(f"'data.sources[{i}]' needs a 'path' (a token store, a Megatron prefix or a "
                       f"file of ids)", value.item_loc(i))
        spec = SourceSpec(path=path or "", weight=s.number("weight", 1.0),
                          dtype=_token_dtype(s, "dtype", s.get("dtype", str, None)), loc=s.m.loc, locs=s.locs())
        _finite(s, "weight", spec.weight)
        s.at_least("weight", spec.weight, 0)
        out.append(spec)
    if all(s.weight <= 0 for s in out):
        r.errs.add("'data.sources' has no positive weight: no source would be drawn", r.loc("sources"))
    return out


def parse_eval(doc: LMap, errs: ErrorList) -> EvalSpec:
    r = Reader.section(errs, doc, "eval", _fields(EvalSpec))
    spec = EvalSpec(path=r.get("path", str, None), fraction=r.number("fraction", None),
                    interval=r.get("interval", int, 0), batches=r.get("batches", int, None),
                    loc=r.m.loc, locs=r.locs())
    r.at_least("interval", spec.interval, 0)
    r.at_least("batches", spec.batches, 1)
    if spec.fraction is not None and not 0 < spec.fraction < 1:
        errs.add(f"'eval.fraction' must be between 0 and 1 (the share of the training data "
                 f"held out), got {spec.fraction}", r.loc("fraction"))
    if spec.path is not None and spec.fraction is not None:
        errs.add("'eval' takes 'path' (a held-out file) or 'fraction' (of the training data), "
                 "not both", r.loc("fraction"))
    elif not spec.enabled and len(r.m):
        errs.add("'eval' needs 'path' (a held-out file or folder, read like data.path) or "
                 "'fraction' (e.g. 0.05 of the training data)", doc.key_loc("eval"))
    return spec


def parse_checkpoint(doc: LMap, errs: ErrorList) -> CheckpointSpec:
    d = CheckpointSpec()
    r = Reader.section(errs, doc, "checkpoint", _fields(CheckpointSpec))
    spec = CheckpointSpec(enabled=r.get("enabled", bool, d.enabled),
                          interval=r.get("interval", int, d.interval),
                          keep=r.get("keep", int, d.keep), dir=r.get("dir", str, None),
                          on_signal=r.get("on_signal", bool, d.on_signal),
                          verify=r.get("verify", bool, d.verify),
                          loc=r.m.loc, locs=r.locs())
    for key in ("interval", "keep"):
        r.at_least(key, getattr(spec, key), 0)
    return spec


def parse_metrics(doc: LMap, errs: ErrorList) -> MetricsSpec:
    d = MetricsSpec()
    r = Reader.section(errs, doc, "metrics", _fields(MetricsSpec))
    spec = MetricsSpec(run_dir=r.get("run_dir", str, None),
                       log_interval=r.get("log_interval", int, d.log_interval),
                       tensorboard=_tensorboard(r), wandb=_wandb(r), profile=_profile(r),
                       dry_run=r.get("dry_run", bool, d.dry_run), loc=r.m.loc, locs=r.locs())
    r.at_least("log_interval", spec.log_interval, 1)
    return spec


def _sink(r: Reader, key: str, cls: type) -> Reader | None:
    """A sink's section: ``true`` (its defaults), ``false``/null (off) or a mapping."""
    value = r.m.get(key)
    if value is None or value is False:
        return None
    if value is True:
        value = LMap(r.loc(key))
    if not isinstance(value, LMap):
        r.errs.add(f"'metrics.{key}' must be true, false or a mapping of {', '.join(_fields(cls))}, "
                   f"got {describe(value)} {value!r}", r.loc(key))
        return None
    return Reader(r.errs, f"metrics.{key}", value, r.loc(key), _fields(cls))


def _tensorboard(r: Reader) -> TensorBoardSpec | None:
    s = _sink(r, "tensorboard", TensorBoardSpec)
    return None if s is None else TensorBoardSpec(dir=s.get("dir", str, None))


def _wandb(r: Reader) -> WandbSpec | None:
    s = _sink(r, "wandb", WandbSpec)
    if s is None:
        return None
    d = WandbSpec()
    spec = WandbSpec(project=s.get("project", str, d.project), mode=s.get("mode", str, d.mode),
                     dir=s.get("dir", str, None), name=s.get("name", str, None))
    if spec.mode not in WANDB_MODES:
        r.errs.add(f"'metrics.wandb.mode' must be one of {', '.join(WANDB_MODES)}, got "
                   f"'{spec.mode}'{nearest(spec.mode, WANDB_MODES)}", s.loc("mode"))
        spec.mode = d.mode
    return spec


def _profile(r: Reader) -> tuple[int, int] | None:
    """``START:END`` (steps, both included) or ``[START, END]``; a single step ``N``."""
    value = r.m.get("profile")
    if value is None or value is False:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        pair = [value, value]
    elif isinstance(value, str) and value.count(":") == 1:
        pair = value.split(":")
    elif isinstance(value, LSeq) and len(value) == 2:
        pair = list(value)
    else:
        pair = None
    try:
        first, last = (int(x) for x in pair) if pair is not None and not any(
            isinstance(x, bool) for x in pair) else (None, None)
    except (TypeError, ValueError):
        first = last = None
    if first is None or not 1 <= first <= last:
        r.errs.add(f"'metrics.profile' must be START:END, the steps to profile (1 <= START "
                   f"<= END, e.g. 3:4), got {value!r}", r.loc("profile"))
        return None
    return first, last
