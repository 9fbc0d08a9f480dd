"""One optimizer step of ``tpplan train``, run on fake tensors, its memory followed.

The plan is applied in full (TP, activation checkpointing, FSDP2) to the model built on
the meta device, on the dry run's fake process group; the parameters are then made fake
tensors (``FakeTensorMode``: shapes, dtypes and storages, no bytes), so FSDP2 runs for real
— all-gathers, resharding, reduce-scatters, gradient sync switched off between
micro-batches — and so does AdamW. A warm-up forward and AdamW's state leave what earlier
steps leave (FSDP2 initialized, the last logits still held); the step after them is
followed by a :class:`~tpplan.analysis.memtrace.MemoryTracker`.

The step is the trainer's (``tpplan/train/loop.py``): for each micro-batch, gradient sync
on only for the last when FSDP2 runs and there is accumulation, forward, the loss
``cross_entropy(logits.float()) / accum`` under the plan's loss context, backward; then
the optimizer step and ``zero_grad(set_to_none=True)``. Gradient clipping's few scalars are
left out. Three micro-batches stand for any longer accumulation: every middle one holds
what the second does.

Moments are labelled ``<micro-batch>/<pass>/<module>``, a block by its place: ``head<i>``
for the first 2k blocks, ``tail<i>`` for the last 2k counted from the end, ``middle`` for
the rest (k = 1, or the period of selective checkpointing), so that the same moment can
be found at several depths (:mod:`tpplan.analysis.memory`).
"""

from __future__ import annotations

import bisect
import dataclasses
import warnings
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten

from ..models.introspect import find_blocks
from ..parallel.apply import apply_plan, loss_context
from ..parallel.context import shard_batch
from ..parallel.pipeline import StageBuilder
from ..plan.specs import PlanSpec
from ..plan.step import StepShape
from .hfmasks import as_the_real_run_decides
from .memtrace import MemoryTracker, Moment

__all__ = ["trace_step", "micro_batches_traced", "StageIO"]


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


def _truncate(model: nn.Module, blocks: str, depth: int) -> None:
    parent_path, _, attr = blocks.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    container = getattr(parent, attr)
    if isinstance(container, nn.ModuleDict):  # its own class: a stage's iterates its blocks
        setattr(parent, attr, type(container)(dict(list(container.items())[:depth])))
    else:
        setattr(parent, attr, nn.ModuleList(list(container)[:depth]))


class _Where:
    """The label of the current moment: the step's position, and the module running.

    In forward, global module hooks keep the stack of labelled modules (the blocks, and
    the modules outside them at their outermost level). Backward is attributed through
    autograd itself: each labelled module's forward opens a range of autograd sequence
    numbers (from the newest node among its inputs), and the node autograd is executing
    (``torch._C._current_autograd_node``) falls in one of them. No tensor is held: a
    tracker must not change the memory it measures.
    """

    def __init__(self, model: nn.Module, blocks: str | None, period: int):
        self.root = model
        self.stage = "setup"
        self.mark: str | None = None
        self.labels: dict[int, str] = {}  # id(module) -> label
        children = list(model.get_submodule(blocks).children()) if blocks is not None else []
        depth = len(children)
        for i, block in enumerate(children):
            # Only blocks next to the ends behave differently (their neighbours are not
            # blocks); in between, a moment is linear in the block's index within each
            # residue of the period, so its largest is at the ends of that stretch.
            place = f"head{i}" if i < 2 * period else \
                f"tail{depth - 1 - i}" if i >= depth - 2 * period else "middle"
            self.labels[id(block)] = f"{blocks}.{place}"
        for path, m in model.named_modules():
            inside = blocks is not None and path.startswith(blocks + ".")
            above = blocks is not None and (path == blocks or blocks.startswith(path + ".")
                                            or path == "")
            parent = path.rpartition(".")[0]
            if not (inside or above or path == "") and \
                    id(model.get_submodule(parent)) not in self.labels:
                self.labels[id(m)] = path
        self.labels.pop(id(model), None)
        self.forward_started()

    def forward_started(self) -> None:
        self.stack: list[str] = []
        self.starts: list[int] = []  # autograd sequence numbers where each range begins
        self.names: list[str] = []
        self.high = -1
        self.done = False
        self.last_backward = "<loss>"

    def _seen(self, tensors) -> int:
        high = self.high
        for t in tree_flatten(tensors)[0]:
            fn = getattr(t, "grad_fn", None) if isinstance(t, torch.Tensor) else None
            if fn is not None:
                high = max(high, fn._sequence_nr())
        return high

    def _pre(self, module, args) -> None:
        if torch._C._current_graph_task_id() != -1:
            return  # a checkpointed block recomputed in backward: backward is labelled by node
        label = self.labels.get(id(module))
        if label is not None:
            self.high = self._seen(args)
            self.stack.append(label)
            self.starts.append(self.high)
            self.names.append(label)

    def _post(self, module, args, output) -> None:
        if torch._C._current_graph_task_id() != -1:
            return
        if id(module) in self.labels:
            self.stack.pop()
            self.high = self._seen(output)
        elif module is self.root:
            self.done = True
            self.starts.append(self._seen(output))
            self.names.append("<loss>")

    def __enter__(self):
        from torch.nn.modules.module import (register_module_forward_hook,
                                             register_module_forward_pre_hook)

        self._hooks = [register_module_forward_pre_hook(self._pre),
                       register_module_forward_hook(self._post)]
        return self

    def __exit__(self, *args) -> None:
        for h in self._hooks:
            h.remove()

    def _backward(self) -> str:
        node = torch._C._current_autograd_node()
        # Gradient accumulation into a leaf has no place in forward's order: keep the last.
        if node is not None and type(node).__name__ != "AccumulateGrad":
            i = bisect.bisect_left(self.starts, node._sequence_nr()) - 1
            self.last_backward = self.names[i] if i >= 0 else "<root>"
        return self.last_backward

    def __call__(self) -> str:
        if self.mark is not None:
            return f"{self.stage}/mark/{self.mark}"
        if self.stage in ("setup", "optimizer"):
            return self.stage
        if torch._C._current_graph_task_id() != -1:
            return f"{self.stage}/backward/{self._backward()}"
        where = self.stack[-1] if self.stack else "<loss>" if self.done else "<root>"
        return f"{self.stage}/forward/{where}"


def _local(t: torch.Tensor | None):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _micro_name(m: int, n: int) -> str:
    return "only" if n == 1 else "first" if m == 0 else "last" if m == n - 1 else "middle"


def trace_step(spec: PlanSpec, mesh, build: Callable[[], nn.Module], shape: StepShape,
               depth: int | None = None, io: StageIO | None = None,
               first_forward: bool = False) -> dict[str, Moment]:
    """Run the trainer's step for ``spec`` on fake tensors and return its moments by label.

    ``depth``: keep only the first ``depth`` repeated blocks (the rest are not built into
    the step, nor copied by a :class:`StageBuilder`); ``io``: ``build`` makes one pipeline
    stage, its micro-batches run in turn; ``first_forward``: the warm-up and the first
    micro-batch's forward only (no optimizer state). Needs the dry run's fake process group."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    # Compiled blocks are followed as eager ones (compile under fake tensors is not a step).
    spec = dataclasses.replace(spec, compile=dataclasses.replace(spec.compile, enabled=False))
    model = build(depth) if depth is not None and isinstance(build, StageBuilder) else build()
    blocks = find_blocks(model)
    if depth is not None and blocks is not None:
        _truncate(model, blocks, depth)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apply_plan(spec, model, mesh, stage=io is not None)
        with FakeTensorMode(allow_non_fake_inputs=True), as_the_real_run_decides(model):
            model.to_empty(device="cpu")
            return _run(spec, model, blocks, shape, io or StageIO(True, True), first_forward)


def _run(spec: PlanSpec, model: nn.Module, blocks: str | None, shape: StepShape,
         io: StageIO, first_forward: bool = False) -> dict[str, Moment]:
    t = spec.train
    accum, micro = shape.grad_accum, shape.micro_batch
    n = micro_batches_traced(accum)
    batch = torch.zeros(n * micro, shape.seq_len + 1, dtype=torch.long)
    trained = [p for p in model.parameters() if p.requires_grad]  # as the trainer: not `freeze`'s
    optimizer = torch.optim.AdamW(trained, lr=t.lr, betas=t.betas, eps=t.eps,
                                  weight_decay=t.weight_decay)
    fsdp = hasattr(model, "set_requires_gradient_sync")
    ac = spec.activation_checkpointing
    where = _Where(model, blocks, ac.every if ac.enabled else 1)
    tracker = MemoryTracker(where)

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
    with loss_context(spec):
        forward(batch[:micro])
    held.update({k: v.detach() for k, v in held.items() if v is not None})
    if not first_forward:  # AdamW's state changes nothing a forward saves
        for p in trained:  # a gradient marks a parameter as one AdamW's step updates
            p.grad = torch.zeros_like(p)
        with torch.no_grad():  # the state as ``step`` makes it (its lazy init), not stepped
            for g in optimizer.param_groups:
                optimizer._init_group(g, [], [], [], [], [], [])
        optimizer.zero_grad(set_to_none=True)
    tracker.register(model.parameters(), "parameters")
    tracker.register([*model.buffers(), batch], "buffers")  # and the batch
    tracker.register(held.values(), "activations")
    tracker.register((v for s in optimizer.state.values() for v in s.values()), "optimizer")
    with where, tracker:
        tracker.observe()
        if step(n, lambda: mark("end_forward"), settle):
            where.stage = "optimizer"
            tracker.observe()
    return tracker.moments
