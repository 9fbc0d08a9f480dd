"""Forward and backward of one optimizer step's batch, with or without pipeline stages.

Both go through the public API: ``plan.apply`` and gradient accumulation over micro-batches,
or ``plan.apply_pipeline`` and the schedule's ``step`` (the micro-batches are the schedule's,
the loss is computed on the last stage). Either returns this rank's part of the global mean
loss (:mod:`.evaluate`'s normalisation); the trainer sums it over the world.
"""

from __future__ import annotations

import torch
from torch import nn

from ..parallel.context.sequence import position_kwarg, shard_batch
from ..models.moe_loss import aux_loss, with_aux_loss
from .evaluate import IGNORE_INDEX, plain_loss, target_loss

__all__ = ["PipelineStepper", "PlainStepper", "make_stepper"]


class PlainStepper:
    """The whole model on this rank: micro-batches accumulate gradients one after another."""

    def __init__(self, plan, model: nn.Module, micro: int, accum: int, dp_scale: int,
                 micro_batches: int = 1):
        self.plan, self.model, self.micro, self.accum, self.dp_scale = \
            plan, model, micro, accum, dp_scale
        # a MoE's aux loss is per forward: the step's is their mean over the global batch's
        self.micro_batches = micro_batches
        self.parts = [model]
        self.can_skip_sync = hasattr(model, "set_requires_gradient_sync") and accum > 1
        # a model that takes no positions (a user's own) trains on packed data unmasked
        self.takes_positions = position_kwarg(model) is not None
        self.chunk = plan.train.loss_chunk

    def __call__(self, tokens: torch.Tensor, mask: torch.Tensor | None, count: int,
                 positions: torch.Tensor | None = None) -> torch.Tensor:
        loss_sum = torch.zeros((), device=tokens.device)
        for m in range(self.accum):
            part = slice(m * self.micro, (m + 1) * self.micro)
            if self.can_skip_sync:  # reduce-scatter gradients once, on the last micro-batch
                self.model.set_requires_gradient_sync(m == self.accum - 1)
            inputs, targets = tokens[part, :-1], tokens[part, 1:]
            if mask is not None:
                targets = targets.masked_fill(~mask[part], IGNORE_INDEX)
            # under context parallelism this rank's part of the sequence (and its positions)
            pos = None if positions is None or not self.takes_positions \
                else positions[part, :-1]  # packed documents, masked from each other
            inputs, targets, kwargs = shard_batch(self.model, inputs, targets, pos)
            with self.plan.loss_context():
                loss = target_loss(self.model(inputs, **kwargs), targets, self.chunk) / count
                loss = with_aux_loss(loss, aux_loss(self.model), 1 / self.micro_batches)
                (loss * self.dp_scale).backward()
            loss_sum += plain_loss(loss.detach())
        return loss_sum


class _ScaledLoss:
    """The schedule's loss on the last stage: summed cross-entropy times ``scale``, set per
    step to ``dp / count`` (FSDP2 averages gradients over the dp ranks; see .evaluate)."""

    def __init__(self, chunk: int = 0):
        self.scale, self.chunk = 1.0, chunk

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return target_loss(logits, targets, self.chunk) * self.scale


class PipelineStepper:
    """This rank's pipeline stages: the schedule runs every micro-batch's forward and
    backward; only the last stage has losses to report (zero elsewhere)."""

    def __init__(self, plan, model: nn.Module, mesh, device: torch.device, dp_scale: int):
        self.plan, self.dp_scale = plan, dp_scale
        self.loss_fn = _ScaledLoss(plan.train.loss_chunk)
        # scale_grads off: the loss already carries the 1/count of the global mean.
        self.pipe = plan.apply_pipeline(model, mesh, self.loss_fn, device, scale_grads=False)
        self.parts = self.pipe.modules
        self.takes_positions = position_kwarg(self.parts[0]) is not None

    def __call__(self, tokens: torch.Tensor, mask: torch.Tensor | None, count: int,
                 positions: torch.Tensor | None = None) -> torch.Tensor:
        targets = tokens[:, 1:]
        if mask is not None:
            targets = targets.masked_fill(~mask, IGNORE_INDEX)
        pos = None if positions is None or not self.takes_positions else positions[:, :-1]
        # every stage of this rank holds the same cp layout: any one shards the batch; the
        # positions go to every stage (a stage sees hidden states only)
        inputs, targets, kwargs = shard_batch(self.parts[0], tokens[:, :-1], targets, pos)
        self.loss_fn.scale = self.dp_scale / count
        losses: list[torch.Tensor] = []
        with self.plan.loss_context():
            self.pipe.step(inputs, target=targets, losses=losses, **kwargs)
        total = torch.zeros((), device=tokens.device)
        for loss in losses:
            total += plain_loss(loss.detach())
        return total / self.dp_scale


def make_stepper(plan, model: nn.Module, mesh, device: torch.device, micro: int, accum: int,
                 dp_scale: int, dp: int = 1):
    """The stepper for the plan: parallelizes ``model`` (meta) via the public API. ``dp``:
    the data-parallel ranks (a step's micro-batches are ``accum × dp``)."""
    if plan.pipeline is not None:
        return PipelineStepper(plan, model, mesh, device, dp_scale)
    return PlainStepper(plan, plan.apply(model, mesh), micro, accum, dp_scale, accum * dp)
