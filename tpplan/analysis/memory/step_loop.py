"""The trainer's step as :mod:`tpplan.analysis.memory.step` runs it on fake tensors, under a
memory tracker: its micro-batches (forward, loss, backward, gradient sync only on the last),
AdamW's step, the warm-up earlier steps leave, and every tensor the step starts with
registered under its part.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from ...checkpoint.optim_state import init_state
from ...parallel.apply import loss_context
from ...parallel.context.sequence import shard_batch
from ...parallel.tp.loss import cross_entropy
from ...plan.specs import PlanSpec
from ...plan.step import StepShape
from .dp_shards import ScalableTracker
from .step_labels import Where
from .tracker import MemoryTracker

__all__ = ["TracedStep", "micro_batches_traced"]


def micro_batches_traced(accum: int) -> int:
    """Micro-batches run for a step of ``accum``: first, middle, last (fewer if fewer)."""
    return min(accum, 3)


def _local(t: torch.Tensor | None):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _micro_name(m: int, n: int) -> str:
    return "only" if n == 1 else "first" if m == 0 else "last" if m == n - 1 else "middle"


class TracedStep:
    """One model's step under a tracker, as the trainer runs it. ``io``: the pipeline stage's
    ends (:class:`~tpplan.analysis.memory.step.StageIO`); ``first_forward``: the first
    micro-batch's forward only; ``shards``: the storages of FSDP2's sharded parameters, to
    follow shards apart (a :class:`~tpplan.analysis.memory.dp_shards.ScalableTracker`)."""

    def __init__(self, spec: PlanSpec, model: nn.Module, blocks: str | None, shape: StepShape, io,
                 first_forward: bool, shards: set[int] | None):
        t = spec.train
        self.spec, self.model, self.io, self.first_forward = spec, model, io, first_forward
        self.accum, self.micro = shape.grad_accum, shape.micro_batch
        self.n = micro_batches_traced(self.accum)
        self.batch = torch.zeros(self.n * self.micro, shape.seq_len + 1, dtype=torch.long)
        self.trained = [p for p in model.parameters() if p.requires_grad]  # as the trainer: not `freeze`'s
        self.optimizer = torch.optim.AdamW(self.trained, lr=t.lr, betas=t.betas, eps=t.eps,
                                           weight_decay=t.weight_decay)
        self.fsdp = hasattr(model, "set_requires_gradient_sync")
        self.where = Where(model, blocks, spec.activation_checkpointing.every)  # 1 unless selective (ACSpec)
        self.tracker = MemoryTracker(self.where) if shards is None else ScalableTracker(self.where)
        # The trainer's loop variables: the last logits and loss live on until the next forward.
        self.held: dict[str, torch.Tensor | None] = {"logits": None, "loss": None}

    def step(self, micro_batches: int, on_forward: Callable[[], None] | None = None,
             on_backward: Callable[[], None] | None = None) -> bool:
        """``micro_batches`` forward and backward, then AdamW's step; False where
        ``first_forward`` stopped it after the first forward."""
        where, tracker, io, micro = self.where, self.tracker, self.io, self.micro
        for m in range(micro_batches):
            where.stage = _micro_name(m, micro_batches)
            where.forward_started()
            x = self.batch[m * micro:(m + 1) * micro]
            if self.fsdp and self.accum > 1:  # the trainer's: reduce-scatter once, on the last
                self.model.set_requires_gradient_sync(m == micro_batches - 1)
            with loss_context(self.spec):
                tracker.phase = "activations"
                self.forward(x)
                if on_forward:
                    on_forward()
                if self.first_forward:
                    return False  # the prefix asked for: the rest of the step is not run
                tracker.phase = "transients"
                if io.last:
                    self.held["loss"].backward()
                else:  # the gradient the next stage sends back
                    self.held["logits"].backward(torch.zeros_like(self.held["logits"]))
            if on_backward:
                on_backward()
        where.stage = "optimizer"
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return True

    def forward(self, x: torch.Tensor) -> None:
        io, held = self.io, self.held
        # the trainer's: under cp, this rank's part of the sequence, its positions to every stage
        inputs, targets, kwargs = shard_batch(self.model, x[:, :-1], x[:, 1:])
        if not io.first:  # what the previous stage sent (PipelineStage's receive buffer)
            inputs = torch.zeros(io.received[0], dtype=io.received[1], requires_grad=True)
        held["logits"] = self.model(inputs, **kwargs)
        if io.last:
            # the trainer's loss (chunked over a large vocabulary: train.loss_chunk)
            held["loss"] = cross_entropy(held["logits"], targets, self.spec.train.loss_chunk,
                                         reduction="mean") / self.accum
        else:
            io.sent = (tuple(held["logits"].shape), held["logits"].dtype)

    def mark(self, name: str) -> None:
        self.where.mark = name
        self.tracker.observe()
        self.where.mark = None

    def settle(self) -> None:
        self.tracker.settle(_local(p.grad) for p in self.trained)
        self.mark("end_backward")

    def warm_up(self) -> None:
        """As the trainer's earlier steps leave things: FSDP2's lazy init (a forward), the
        last logits and loss still held (graph freed, as backward frees it) and AdamW's state.
        Before a first forward alone, only its batch preparation (what it keeps: cp's sequence
        layout): the activations at that forward's end are the same without the rest (the
        logits and loss held are replaced by then; FSDP2's lazy init and the parameters it
        gathers are no activations), which would cost a forward more."""
        micro = self.micro
        if self.first_forward:
            shard_batch(self.model, self.batch[:micro, :-1], self.batch[:micro, 1:])
        else:
            with loss_context(self.spec):
                self.forward(self.batch[:micro])
            # The trainer's last logits and loss kept, their graph freed (as backward frees it).
            self.held.update({k: v.detach() for k, v in self.held.items() if v is not None})
        if not self.first_forward:  # AdamW's state changes nothing a forward saves
            init_state(self.optimizer)  # the state as ``step`` makes it (its lazy init), not stepped

    def register(self, shards: set[int] | None) -> None:
        """Every tensor the step starts with, under its part: parameters (FSDP2's shards
        apart, where ``shards`` are followed), buffers and the batch, the held activations
        and AdamW's state (a shard's own apart)."""
        optimizer, tracker = self.optimizer, self.tracker

        def sharded(t: torch.Tensor) -> bool:  # FSDP2's shard, or AdamW's state of one
            return shards is not None and id(_local(t).untyped_storage()) in shards

        state = {id(v) for p, s in optimizer.state.items() if sharded(p) for v in s.values()
                 if isinstance(v, torch.Tensor) and _local(v).numel() == _local(p).numel()}
        tracker.register(self.model.parameters(), "parameters", sharded)
        tracker.register([*self.model.buffers(), self.batch], "buffers")  # and the batch
        tracker.register(self.held.values(), "activations")
        tracker.register((v for s in optimizer.state.values() for v in s.values()), "optimizer",
                         lambda t: id(t) in state)
