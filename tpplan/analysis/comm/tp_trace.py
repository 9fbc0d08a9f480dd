"""Tensor-parallel collectives, counted by running the plan's TP forward+backward on meta.

A second meta model gets only the TP part of the plan (``tpplan.parallel.apply.apply_tp`` with the
dry run's resolution), is cast to the compute dtype FSDP's mixed precision would use, and
runs one micro-batch forward, loss (under the plan's ``loss_context``) and backward inside a
:class:`CollectiveRecorder`. Nothing is allocated: meta tensors carry shapes only.

Deep models are traced once, at 4 of their repeated blocks (4k under selective
checkpointing of every k-th block, r + 3k where k leaves a remainder r), each collective
counted by the period of blocks it ran in (after backward, that of the parameter whose
gradient it reduces). For identical blocks (same module types, parameter shapes and plan
rules) every block receives its input in the layout the previous one produced and its
input's gradient in the one the next sends back, so a period with a period on each side
issues what any other such period does: the second and third are held equal, and a model of
L blocks issues the trace's collectives and (L − D)/k times the second period's (D the
depth traced). If they differ, or the blocks do, the whole model is traced instead.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...models.introspect import find_blocks
from ...parallel.apply import loss_context
from ...parallel.tp.attention import fused_attention_on_meta
from ...parallel.context.sequence import shard_batch
from ...parallel.lora.sizes import same_in_every_block
from ...parallel.pipeline.split import StageBuilder
from ...parallel.resolve import Resolution
from ...plan.patterns import generalize
from ...plan.specs import PlanSpec
from .counting import CollectiveRecorder
from .tp_model import prepare_traced, trace_meshes
from ..memory.per_rank import kept_traces, period_depths
from ..memory.step import ModelBuilder, StageIO, truncated

__all__ = ["TPTrace", "trace_tp", "Key", "identical_blocks"]

log = logging.getLogger("tpplan")

# (kind, mesh dimension, backward?, bytes of the buffer, module pattern)
Key = tuple[str, str, bool, int, str]


class TPTrace:
    """Collectives of one micro-batch: ``counts[key]`` over :data:`Key`; ``depths`` traced;
    ``period``: what one period of blocks with a period on each side issues, where the
    one-run trace held the second and third equal (:mod:`tpplan.analysis.comm.stage_bound`)."""

    def __init__(self, counts: Counter, depths: list[int], blocks: str | None,
                 period: Counter | None = None):
        self.counts, self.depths, self.blocks, self.period = counts, depths, blocks, period


def identical_blocks(model: nn.Module, rule_of: dict) -> tuple[nn.Module, str, str] | None:
    """The repeated blocks (:func:`find_blocks`) as (parent, attribute, path), if there are
    ≥3 of them and they are identical: same module types, parameter shapes and plan rules."""
    path = find_blocks(model)
    if path is None:
        return None
    container = model.get_submodule(path)
    if len(container) < 3:
        return None
    sigs = set()
    for name, child in container.named_children():
        prefix = f"{path}.{name}" if path else name
        sigs.add(tuple(
            (rel, type(m).__name__, id(rule_of.get(f"{prefix}.{rel}" if rel else prefix)),
             tuple((n, tuple(p.shape)) for n, p in m.named_parameters(recurse=False)))
            for rel, m in child.named_modules()))
    if len(sigs) != 1:
        return None
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    return parent, attr, path


@contextlib.contextmanager
def _naming_the_module(rec: CollectiveRecorder):
    """An operation the trace cannot run (a meta tensor's data-dependent shape, an in-place
    write to a hooked module's output) re-raised with the module it ran in and the pass:
    the one operation that stops the analysis, located in the model."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - re-raised, with where
        tracker = rec.advanced_module_tracker
        first = str(e).strip().split(". ")[0].splitlines()[0] if str(e).strip() else ""
        name = tracker.name.partition(".")[2] or tracker.name  # less the root's class name
        where = f" (in module '{name}', {'backward' if tracker.is_bw else 'forward'})"
        try:
            located = type(e)(f"{first}{where}")
        except Exception:  # noqa: BLE001 - an exception type that takes more than a message
            located = RuntimeError(f"{type(e).__name__}: {first}{where}")
        raise located from None


def _run(model: nn.Module, plan: PlanSpec, tokens: torch.Tensor, groups: dict[str, str],
         io: StageIO | None = None, place: Callable[[str], int | None] = lambda _: None
         ) -> Counter:
    """The collectives of one micro-batch, counted by ``(place, key)``: ``place(module)``
    of the module each ran in (of the parameter whose gradient it reduces, after backward),
    the position of its repeated block, or None outside them."""
    model.zero_grad(set_to_none=True)  # each trace starts as a fresh step would
    io = io or StageIO(True, True)
    with CollectiveRecorder() as rec, fused_attention_on_meta(), _naming_the_module(rec):
        with loss_context(plan):
            # under cp, this rank's part of the sequence; its positions go to every stage
            inputs, targets, kwargs = shard_batch(model, tokens, tokens)
            if not io.first:  # what the previous stage sent (PipelineStage's receive buffer)
                inputs = torch.zeros(io.received[0], dtype=io.received[1], device="meta",
                                     requires_grad=True)
            logits = model(inputs, **kwargs)
            if io.last:
                loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
                loss.backward()  # loss parallelism's backward also needs the context
            else:  # the gradient the next stage sends back
                io.sent = (tuple(logits.shape), logits.dtype)
                logits.backward(torch.zeros_like(logits))
        in_backward = len(rec.collectives)
        owners = _reduce_partial_grads(model, rec)
    counts: Counter = Counter()
    root = type(model).__name__ + "."
    for i, c in enumerate(rec.collectives):
        module = c.module.removeprefix(root) if c.module != "Global" else "<loss>"
        if c.module == type(model).__name__:
            module = "<root>"
        where = place(module)
        backward = c.backward or i >= in_backward
        if i >= in_backward:
            module, where = "<gradients>", place(owners[i - in_backward])
        counts[where, (c.kind, groups[c.group], backward, c.bytes,
                       generalize(module))] += 1
    return counts


def _reduce_partial_grads(model: nn.Module, rec: CollectiveRecorder) -> list[str]:
    """Bring each gradient to its parameter's placement, as FSDP2 (or the optimizer) does;
    the parameter's name for each collective that issues, in order.

    A weight replicated over tp but used on sequence shards (a sequence-parallel norm) gets
    a partial gradient; turning it into the replicated one is an all-reduce per step that
    only appears when the gradient is used, after backward.
    """
    from torch.distributed.tensor import DTensor

    owners: list[str] = []
    for name, p in model.named_parameters():
        g = p.grad
        if isinstance(p, DTensor) and isinstance(g, DTensor) and g.placements != p.placements:
            before = len(rec.collectives)
            p.grad = g.redistribute(p.device_mesh, p.placements)
            owners += [name] * (len(rec.collectives) - before)
    return owners


def _unplaced(counts: Counter) -> Counter:
    """:func:`_run`'s counts by key alone."""
    out: Counter = Counter()
    for (_, key), n in counts.items():
        out[key] += n
    return out


def trace_tp(plan: PlanSpec, res: Resolution, mesh, build: Callable[[], nn.Module], seq_len: int,
             micro_batch: int, dtype: torch.dtype, extrapolate: bool = True,
             io: StageIO | None = None, shallow: tuple[dict, object] | None = None) -> TPTrace:
    """Count one micro-batch's TP collectives of ``plan`` (needs the fake process group up).

    ``extrapolate=False`` traces every block (slower; the result must be the same). ``io``:
    ``build`` makes one pipeline stage (``res`` resolved on it): a stage after the first
    takes an activation of ``io.received``, one before the last runs backward from a
    gradient of its output, whose (shape, dtype) goes to ``io.sent``. ``shallow``: ``(cache,
    key)``: the shallow trace of identical blocks kept under ``key``, which the caller makes
    of everything it reads except the depth (``search``: pipeline stages of every length
    share it; the extrapolation to this depth is the same arithmetic). A stage's ``build``
    as a :class:`StageBuilder`: read in place for its blocks, copied only to be run (its
    first ``4k`` blocks for the shallow trace)."""
    import warnings

    meshes = trace_meshes(mesh, res)
    groups = meshes.groups
    tokens = torch.zeros(micro_batch, seq_len, dtype=torch.long, device="meta")

    def prepared(model: nn.Module) -> nn.Module:
        return prepare_traced(model, plan, res, meshes, dtype)

    def blocks_of(m: nn.Module) -> tuple[str, int] | None:
        # LoRA on some blocks only (or `freeze`): not identical blocks, traced whole.
        found = identical_blocks(m, res.rule_of) \
            if extrapolate and same_in_every_block(plan, m) else None
        return found and (found[2], len(getattr(found[0], found[1])))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # full-backward-hook notices on integer inputs
        staged = isinstance(build, StageBuilder)
        copied = staged or isinstance(build, ModelBuilder)  # read in place, copied to run
        model = None if copied else build()
        found = build.read(blocks_of) if copied else blocks_of(model)
        # Selective checkpointing of every k-th block repeats with period k, not 1.
        period = plan.activation_checkpointing.every
        # One trace of 4 periods (3 and the remainder r where k leaves one: a stage of odd
        # length under every second block checkpointed ends as the model does), its
        # checkpointed blocks at the same places from the first.
        r = found[1] % period if found else 0
        traced = period_depths(found[1] if found else 0, period)[-1] + period
        if found is None or found[1] < traced:
            whole = build() if model is None else model
            return TPTrace(_unplaced(_run(prepared(whole), plan, tokens, groups, io)), [], None)
        path, depth = found

        def shallow_run() -> tuple[Counter, Counter, Counter]:
            # Cut before applying TP: the blocks past the traced ones are never run (nor
            # copied, from a stage whose blocks they are).
            run = model if model is not None else \
                build(traced) if not staged or path == build.split.blocks_path else build()
            parent_path, _, attr = path.rpartition(".")
            parent = run.get_submodule(parent_path)
            kept = truncated(getattr(parent, attr), traced)
            setattr(parent, attr, kept)
            prepared(run)
            position = {name: i // period for i, (name, _) in enumerate(kept.named_children())}
            prefix = path + "."

            def place(module: str) -> int | None:  # the period of the block it is in
                return position.get(module[len(prefix):].split(".")[0]) \
                    if module.startswith(prefix) else None

            counts = _run(run, plan, tokens, groups, io, place)
            return (_unplaced(counts), *(Counter({key: n for (where, key), n in counts.items()
                                                  if where == i}) for i in (1, 2)))

        # The remainder is part of the key: a stage of even length runs other depths.
        total, second, third = kept_traces(shallow and (shallow[0], (shallow[1], r)), io,
                                           shallow_run)
        if second != third:
            log.warning("TP collectives differ between alike blocks; tracing all %d blocks",
                        depth)
            return TPTrace(_unplaced(_run(prepared(build()), plan, tokens, groups, io)), [],
                           None)
        more = (depth - traced) // period
        return TPTrace(+Counter({k: total[k] + more * second[k] for k in total | second}),
                       [traced], path, second)
