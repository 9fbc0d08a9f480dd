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
import contextvars
import copy
import dataclasses
import functools
import importlib.util
import math
import warnings
from typing import Callable, Iterator

import torch.nn as nn

from ..._torch.modules import own_children, swapped
from ...models.introspect import find_blocks
from ...models.moe_loss import gather_router_logits
from ...parallel.apply import apply_plan
from ...parallel.float8 import apply_float8
from ...parallel.pipeline.split import StageBuilder
from ...plan.specs import PlanSpec
from ...plan.step import StepShape
from ..fake.hf_masks import as_the_real_run_decides
from .dp_shards import ScaledTrace, fsdp_shards
from ..fake.tensors import fake_mode
from .step_loop import TracedStep, micro_batches_traced
from .tracker import MemoryTracker

__all__ = ["trace_step", "count_kernels", "shared_steps", "SharedSteps", "first_forward_ends",
           "forward_activations", "truncated", "micro_batches_traced", "StageIO", "ModelBuilder"]


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
        with swapped(parent, children={attr: truncated(own_children(parent)[attr], depth)}):
            return copy.deepcopy(self._model)


def _parent(model: nn.Module, blocks: str) -> tuple[nn.Module, str]:
    parent_path, _, attr = blocks.rpartition(".")
    return (model.get_submodule(parent_path) if parent_path else model), attr


def _float8_emulated(spec: PlanSpec, model: nn.Module, mesh) -> None:
    """The plan's ``float8`` linears converted as a GPU run converts them, in torchao's emulated
    mode (the same casts, scales and tensors saved for backward, FSDP2's float8 all-gather under
    tensorwise scaling; only the product is taken in fp32 from upcast operands), so the trace holds
    what float8 keeps. Where torchao is not installed they are traced in the parameter dtype."""
    if spec.float8 is None or mesh.device_type == "cuda" or importlib.util.find_spec("torchao") is None:
        return
    names = mesh.mesh_dim_names or ()
    shards = math.prod(mesh[n].size() for n in ("dp_shard", "cp") if n in names)
    gathers = spec.float8.scaling == "tensorwise" and spec.fsdp is not None and shards > 1
    apply_float8(model, spec, gathers, emulate=True)


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
        _float8_emulated(spec, model, mesh)
        gather_router_logits(model, apply_plan(spec, model, mesh, stage=io is not None).router_shards)
        with fake_mode(allow_non_fake_inputs=True), as_the_real_run_decides(model):
            model.to_empty(device="cpu")
            yield spec, model, blocks, io or StageIO(True, True)


def trace_step(spec: PlanSpec, mesh, build: Callable[[], nn.Module], shape: StepShape,
               depth: int | None = None, io: StageIO | None = None,
               first_forward: bool = False, scalable: bool = False):
    """Run the trainer's step for ``spec`` on fake tensors and return its moments by label.

    ``depth``: keep only the first ``depth`` repeated blocks (the rest are not built into
    the step, nor copied by a :class:`StageBuilder`); ``io``: ``build`` makes one pipeline
    stage, its micro-batches run in turn; ``first_forward``: the first micro-batch's
    forward only (no warm-up, no optimizer state); ``scalable``: FSDP2's shards followed
    apart, a :class:`~tpplan.analysis.memory.dp_shards.ScaledTrace` returned (the moments at any
    ``dp_shard``). Needs the dry run's fake process group. Inside :func:`shared_steps`, a
    scalable step is the one :func:`count_kernels` ran with the same arguments, if it did."""
    shared = _SHARED.get()
    if shared is not None and scalable and not first_forward:
        trace = shared.traces.pop(shared.key(spec, mesh, build, shape, depth, io), None)
        if trace is not None:  # run by count_kernels: its moments are these
            if io is not None:
                io.sent = trace.sent
            return trace
    return _traced(spec, mesh, build, shape, depth, io, first_forward, scalable)


def _traced(spec: PlanSpec, mesh, build: Callable[[], nn.Module], shape: StepShape,
            depth: int | None, io: StageIO | None, first_forward: bool = False,
            scalable: bool = False, kernels=None):
    """:func:`trace_step`'s trace; ``kernels``: every operator counted into it as well."""
    with _on_fake_tensors(spec, mesh, build, depth, io) as (spec, model, blocks, io):
        shards = fsdp_shards(model) if scalable else None
        tracker = _run(spec, model, blocks, shape, io, first_forward, shards and shards[0],
                       kernels=kernels)
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


def count_kernels(spec: PlanSpec, mesh, build: Callable[[], nn.Module], shape: StepShape,
                  depth: int | None, kernels, io: StageIO | None = None) -> None:
    """The trainer's step for ``spec`` (its first ``depth`` blocks) on fake tensors, every
    operator of it counted into ``kernels`` (a :class:`~tpplan.analysis.memory.kernels.KernelCount`);
    ``io``: ``build`` makes one pipeline stage (:func:`trace_step`'s). Inside
    :func:`shared_steps`, the step is traced as a scalable :func:`trace_step` and kept for it."""
    shared = _SHARED.get()
    if shared is None:
        with _on_fake_tensors(spec, mesh, build, depth, io) as (spec, model, blocks, io):
            _run(spec, model, blocks, shape, io, kernels=kernels)
        return
    shared.keep(shared.key(spec, mesh, build, shape, depth, io),
                _traced(spec, mesh, build, shape, depth, io, scalable=True, kernels=kernels))


class SharedSteps:
    """One step traced for both analyses of an exhaustive search's candidate that run it: its
    memory-bound kernels (:func:`count_kernels`, asked first) and its memory (a scalable
    :func:`trace_step`, next), the same step on the same fake tensors, the kernel count
    riding on the memory tracker (which only watches). Keyed by everything the step reads:
    the plan (its text), the mesh, what ``build`` makes, the step's shape, the depth and the
    stage's ends; taken once (the memory analysis keeps its own cache). At most ``KEPT``
    wait, the oldest let go first (a memory analysis served by another dp_shard's trace,
    or at other depths, never asks): one let go is traced again when asked for."""

    KEPT = 64

    def __init__(self) -> None:
        self.traces: dict[tuple, ScaledTrace] = {}

    @staticmethod
    def key(spec: PlanSpec, mesh, build, shape: StepShape, depth: int | None,
            io: StageIO | None) -> tuple:
        made = (build.stage.blocks, build.stage.extras) if isinstance(build, StageBuilder) else None
        return (repr(spec), mesh, made, shape, depth, io and (io.first, io.last, io.received))

    def keep(self, key: tuple, trace: ScaledTrace) -> None:
        self.traces[key] = trace
        while len(self.traces) > self.KEPT:
            del self.traces[next(iter(self.traces))]


_SHARED: contextvars.ContextVar[SharedSteps | None] = contextvars.ContextVar("shared_steps", default=None)


@contextlib.contextmanager
def shared_steps(enabled: bool = True) -> Iterator[SharedSteps | None]:
    """Within (where ``enabled``): :class:`SharedSteps` between :func:`count_kernels` and
    :func:`trace_step` (scalable), for one plan's model (an exhaustive ``search``)."""
    token = _SHARED.set(SharedSteps() if enabled else None)
    try:
        yield _SHARED.get()
    finally:
        _SHARED.reset(token)


def _run(spec: PlanSpec, model: nn.Module, blocks: str | None, shape: StepShape,
         io: StageIO, first_forward: bool = False, shards: set[int] | None = None,
         period: int | None = None, kernels=None) -> MemoryTracker:
    """The step run under a tracker; ``shards``: the storages of FSDP2's sharded
    parameters (:func:`~tpplan.analysis.memory.dp_shards.fsdp_shards`), to follow shards apart;
    ``period``: the live activations at the end of every ``period``-th block's forward
    kept in the tracker's ``ends``."""
    run = TracedStep(spec, model, blocks, shape, io, first_forward, shards)
    run.warm_up()
    run.register(shards)
    tracker, where = run.tracker, run.where
    tracker.ends, tracker.kernels = [], kernels
    hooks = [block.register_forward_hook(lambda *_: tracker.ends.append(
        tracker.live["activations"])) for i, block in enumerate(
            getattr(*_parent(model, blocks)).children()) if i % period == period - 1] \
        if period else []
    with where, tracker:
        tracker.observe()
        if run.step(run.n, lambda: run.mark("end_forward"), run.settle):
            where.stage = "optimizer"
            tracker.observe()
    for hook in hooks:
        hook.remove()
    return tracker
