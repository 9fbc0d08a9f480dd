"""One optimizer step of ``tpplan train``, run on fake tensors, its memory followed.

The plan is applied in full (TP, activation checkpointing, FSDP2) to the model built on
the meta device, on the dry run's fake process group; the parameters are then made fake
tensors (``FakeTensorMode``: shapes, dtypes and storages, no bytes), so FSDP2 runs for real
— all-gathers, resharding, reduce-scatters, gradient sync switched off between
micro-batches — and so does AdamW. A warm-up forward and AdamW's state leave what earlier
steps leave (FSDP2 initialized, the last logits still held); the step after them is
followed by a :class:`~tpplan.analysis.memory.tracker.MemoryTracker`.

The step is the trainer's (``tpplan/train/loop.py``): for each micro-batch, gradient sync
on only for the last when FSDP2 runs and there is accumulation, forward, the loss
``cross_entropy(logits.float()) / accum`` under the plan's loss context, backward; then
the optimizer step and ``zero_grad(set_to_none=True)``. Gradient clipping's few scalars are
left out. Three micro-batches stand for any longer accumulation: every middle one holds
what the second does.

Moments are labelled ``<micro-batch>/<pass>/<module>``, a block by its place: ``head<i>``
for the first 2k blocks, ``tail<i>`` for the last 2k counted from the end, ``middle`` for
the rest (k = 1, or the period of selective checkpointing), so that the same moment can
be found at several depths (:mod:`tpplan.analysis.memory.per_rank`; :class:`~tpplan.analysis.memory.step_labels.Where`
names them).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import warnings
from typing import Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...models.introspect import find_blocks
from ...parallel.apply import apply_plan, loss_context
from ...parallel.context.sequence import shard_batch
from ...parallel.pipeline.split import StageBuilder
from ...plan.specs import PlanSpec
from ...checkpoint.optim_state import init_state
from ...plan.step import StepShape
from ..fake.hf_masks import as_the_real_run_decides
from .dp_shards import ScalableTracker, ScaledTrace, fsdp_shards
from ..fake.tensors import fake_mode
from .tracker import MemoryTracker
from .step_labels import Where

__all__ = ["trace_step", "first_forward_ends", "forward_activations", "truncated",
           "micro_batches_traced", "StageIO", "ModelBuilder"]


@dataclasses.dataclass
class StageIO:
    """A pipeline stage's ends in the traced step: the first stage takes the tokens, a later
    one an activation of ``received`` (shape, dtype) that needs a gradient; the last computes
    the loss, an earlier one runs backward from a gradient of its output, whose (shape,
    dtype) the trace records in ``sent``."""

    first: bool
    last: bool
    received: tuple | None = None
    sent: tuple | None = None


def micro_batches_traced(accum: int) -> int:
    """Micro-batches run for a step of ``accum``: first, middle, last (fewer if fewer)."""
    return min(accum, 3)


def truncated(container: nn.Module, depth: int) -> nn.Module:
    """A blocks container holding the first ``depth`` of ``container``'s blocks."""
    if isinstance(container, nn.ModuleDict):  # its own class: a stage's iterates its blocks
        return type(container)(dict(list(container.items())[:depth]))
    return nn.ModuleList(list(container)[:depth])


class ModelBuilder:
    """What :class:`~tpplan.parallel.pipeline.split.StageBuilder` is to a stage, for a whole meta
    model: ``build(depth)`` a new copy holding only its first ``depth`` repeated blocks,
    copied from one model made once (``make()``, or ``template``: read in place, never
    applied; the blocks past ``depth`` are not copied), where a shallow trace would build
    the whole model to cut it; ``build()`` ``make()`` itself; :meth:`read` reads the model
    without a copy."""

    def __init__(self, make: Callable[[], nn.Module], template: nn.Module | None = None):
        self.make, self._model = make, template

    def read(self, fn: Callable[[nn.Module], object]) -> object:
        if self._model is None:
            self._model = self.make()
        return fn(self._model)

    @functools.cached_property
    def _blocks(self) -> str | None:
        """The template's blocks path, found once."""
        return self.read(find_blocks)

    def __call__(self, depth: int | None = None) -> nn.Module:
        blocks = self._blocks
        if depth is None or blocks is None:
            return self.make()
        parent, attr = _parent(self._model, blocks)
        whole = parent._modules[attr]
        parent._modules[attr] = truncated(whole, depth)
        try:
            return copy.deepcopy(self._model)
        finally:
            parent._modules[attr] = whole


def _parent(model: nn.Module, blocks: str) -> tuple[nn.Module, str]:
    parent_path, _, attr = blocks.rpartition(".")
    return (model.get_submodule(parent_path) if parent_path else model), attr


def _local(t: torch.Tensor | None):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _micro_name(m: int, n: int) -> str:
    return "only" if n == 1 else "first" if m == 0 else "last" if m == n - 1 else "middle"


@contextlib.contextmanager
def _on_fake_tensors(spec: PlanSpec, mesh, build: Callable[[], nn.Module], depth: int | None,
                     io: StageIO | None) -> Iterator[tuple[PlanSpec, nn.Module, str | None, StageIO]]:
    """The model (its first ``depth`` blocks) built on meta, the plan applied and its
    parameters made fake tensors: ``(spec, model, blocks, io)`` while the fake mode is up."""
    # Compiled blocks are followed as eager ones (compile under fake tensors is not a step).
    spec = dataclasses.replace(spec, compile=dataclasses.replace(spec.compile, enabled=False))
    model = build(depth) if depth is not None and isinstance(build, (StageBuilder, ModelBuilder)) \
        else build()
    blocks = find_blocks(model)
    if depth is not None and blocks is not None:
        parent, attr = _parent(model, blocks)
        setattr(parent, attr, truncated(getattr(parent, attr), depth))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apply_plan(spec, model, mesh, stage=io is not None)
        with fake_mode(allow_non_fake_inputs=True), as_the_real_run_decides(model):
            model.to_empty(device="cpu")
            yield spec, model, blocks, io or StageIO(True, True)


def _let_go(held: dict) -> None:
    """The trainer's last logits and loss kept, their graph freed (as backward frees it)."""
    held.update({k: v.detach() for k, v in held.items() if v is not None})


def trace_step(spec: PlanSpec, mesh, build: Callable[[], nn.Module], shape: StepShape,
               depth: int | None = None, io: StageIO | None = None,
               first_forward: bool = False, scalable: bool = False):
    """Run the trainer's step for ``spec`` on fake tensors and return its moments by label.

    ``depth``: keep only the first ``depth`` repeated blocks (the rest are not built into
    the step, nor copied by a :class:`StageBuilder`); ``io``: ``build`` makes one pipeline
    stage, its micro-batches run in turn; ``first_forward``: the first micro-batch's
    forward only (no warm-up, no optimizer state); ``scalable``: FSDP2's shards followed
    apart, a :class:`~tpplan.analysis.memory.dp_shards.ScaledTrace` returned (the moments at any
    ``dp_shard``). Needs the dry run's fake process group."""
    with _on_fake_tensors(spec, mesh, build, depth, io) as (spec, model, blocks, io):
        shards = fsdp_shards(model) if scalable else None
        tracker = _run(spec, model, blocks, shape, io, first_forward, shards and shards[0])
    if shards is None:
        return tracker.moments
    dp_shard = mesh["dp_shard"].size() if "dp_shard" in (mesh.mesh_dim_names or ()) else 1
    return ScaledTrace(tracker.moments, tracker.points, dp_shard, shards[1], io.sent)


def forward_activations(moments: dict) -> int:
    """The ``activations`` part at the end of the first micro-batch's forward."""
    m = moments.get("only/mark/end_forward") or moments["first/mark/end_forward"]
    return m.parts["activations"]


def first_forward_ends(spec: PlanSpec, mesh, build: Callable[[], nn.Module],
                       shape: StepShape, depth: int, period: int,
                       io: StageIO | None = None) -> tuple[int, list[int]]:
    """:func:`forward_activations` of :func:`trace_step` with ``first_forward`` at ``depth``
    blocks, and the activations live at the end of every ``period``-th block of that
    forward (counted from the first), in order."""
    with _on_fake_tensors(spec, mesh, build, depth, io) as (spec, model, blocks, io):
        tracker = _run(spec, model, blocks, shape, io, True, period=period)
    return forward_activations(tracker.moments), tracker.ends


def _run(spec: PlanSpec, model: nn.Module, blocks: str | None, shape: StepShape,
         io: StageIO, first_forward: bool = False, shards: set[int] | None = None,
         period: int | None = None) -> MemoryTracker:
    """The step run under a tracker; ``shards``: the storages of FSDP2's sharded
    parameters (:func:`~tpplan.analysis.memory.dp_shards.fsdp_shards`), to follow shards apart;
    ``period``: the live activations at the end of every ``period``-th block's forward
    kept in the tracker's ``ends``."""
    t = spec.train
    accum, micro = shape.grad_accum, shape.micro_batch
    n = micro_batches_traced(accum)
    batch = torch.zeros(n * micro, shape.seq_len + 1, dtype=torch.long)
    trained = [p for p in model.parameters() if p.requires_grad]  # as the trainer: not `freeze`'s
    optimizer = torch.optim.AdamW(trained, lr=t.lr, betas=t.betas, eps=t.eps,
                                  weight_decay=t.weight_decay)
    fsdp = hasattr(model, "set_requires_gradient_sync")
    ac = spec.activation_checkpointing
    where = Where(model, blocks, ac.every)  # 1 unless selective (ACSpec)
    tracker = MemoryTracker(where) if shards is None else ScalableTracker(where)

    # The trainer's loop variables: the last logits and loss live on until the next forward.
    held: dict[str, torch.Tensor | None] = {"logits": None, "loss": None}

    def step(micro_batches: int, on_forward=None, on_backward=None) -> bool:
        for m in range(micro_batches):
            where.stage = _micro_name(m, micro_batches)
            where.forward_started()
            x = batch[m * micro:(m + 1) * micro]
            if fsdp and accum > 1:  # the trainer's: reduce-scatter once, on the last
                model.set_requires_gradient_sync(m == micro_batches - 1)
            with loss_context(spec):
                tracker.phase = "activations"
                forward(x)
                if on_forward:
                    on_forward()
                if first_forward:
                    return False  # the prefix asked for: the rest of the step is not run
                tracker.phase = "transients"
                if io.last:
                    held["loss"].backward()
                else:  # the gradient the next stage sends back
                    held["logits"].backward(torch.zeros_like(held["logits"]))
            if on_backward:
                on_backward()
        where.stage = "optimizer"
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return True

    def forward(x: torch.Tensor) -> None:
        # the trainer's: under cp, this rank's part of the sequence, its positions to every stage
        inputs, targets, kwargs = shard_batch(model, x[:, :-1], x[:, 1:])
        if not io.first:  # what the previous stage sent (PipelineStage's receive buffer)
            inputs = torch.zeros(io.received[0], dtype=io.received[1], requires_grad=True)
        held["logits"] = model(inputs, **kwargs)
        if io.last:
            held["loss"] = F.cross_entropy(held["logits"].flatten(0, 1).float(),
                                           targets.flatten()) / accum
        else:
            io.sent = (tuple(held["logits"].shape), held["logits"].dtype)

    def mark(name: str) -> None:
        where.mark = name
        tracker.observe()
        where.mark = None

    def settle() -> None:
        tracker.settle(_local(p.grad) for p in trained)
        mark("end_backward")

    # Warm-up, as the trainer's earlier steps leave things: FSDP2's lazy init (a forward), the
    # last logits and loss still held (graph freed, as backward frees it) and AdamW's state.
    # Before a first forward alone, only its batch preparation (what it keeps: cp's sequence
    # layout): the activations at that forward's end are the same without the rest (the
    # logits and loss held are replaced by then; FSDP2's lazy init and the parameters it
    # gathers are no activations), which would cost a forward more.
    if first_forward:
        shard_batch(model, batch[:micro, :-1], batch[:micro, 1:])
    else:
        with loss_context(spec):
            forward(batch[:micro])
        _let_go(held)
    if not first_forward:  # AdamW's state changes nothing a forward saves
        init_state(optimizer)  # the state as ``step`` makes it (its lazy init), not stepped
    def sharded(t: torch.Tensor) -> bool:  # FSDP2's shard, or AdamW's state of one
        return shards is not None and id(_local(t).untyped_storage()) in shards

    state = {id(v) for p, s in optimizer.state.items() if sharded(p) for v in s.values()
             if isinstance(v, torch.Tensor) and _local(v).numel() == _local(p).numel()}
    tracker.register(model.parameters(), "parameters", sharded)
    tracker.register([*model.buffers(), batch], "buffers")  # and the batch
    tracker.register(held.values(), "activations")
    tracker.register((v for s in optimizer.state.values() for v in s.values()), "optimizer",
                     lambda t: id(t) in state)
    tracker.ends = []
    hooks = [block.register_forward_hook(lambda *_: tracker.ends.append(
        tracker.live["activations"])) for i, block in enumerate(
            getattr(*_parent(model, blocks)).children()) if i % period == period - 1] \
        if period else []
    with where, tracker:
        tracker.observe()
        if step(n, lambda: mark("end_forward"), settle):
            where.stage = "optimizer"
            tracker.observe()
    for hook in hooks:
        hook.remove()
    return tracker
