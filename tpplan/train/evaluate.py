"""The loss over the targets that count, and the held-out evaluation.

One normalisation everywhere: the loss of a step is the *sum* of cross-entropy over the
global batch's counted targets (every target, or a chat's assistant tokens only) divided
by their global count, which every rank knows without a collective (:class:`.data.Batch`).
So the loss does not depend on how the batch is cut into micro-batches or ranks: each
micro-batch contributes ``sum / count``, and since FSDP2 *averages* gradients over the
``dp`` data-parallel ranks, each rank scales its part by ``dp``. Ignored targets are
``-100``, which PyTorch's ``loss_parallel`` cross-entropy honours like the plain one.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..data.feed import HeldOut
from ..parallel.context.sequence import position_kwarg, shard_batch
from ..parallel.tp.loss import IGNORE_INDEX, cross_entropy
from .data import Batch, Corpus, document_positions, eval_batch

__all__ = ["IGNORE_INDEX", "Evaluation", "eval_batches", "evaluate", "plain_loss", "summed_loss",
           "target_loss"]


def summed_loss(logits: torch.Tensor, tokens: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
    """Sum of cross-entropy over the counted targets of ``tokens[:, 1:]`` (call it inside
    ``plan.loss_context()``: ``logits`` may be vocabulary-sharded)."""
    targets = tokens[:, 1:]
    if mask is not None:
        targets = targets.masked_fill(~mask, IGNORE_INDEX)
    return target_loss(logits, targets)


def target_loss(logits: torch.Tensor, targets: torch.Tensor, chunk: int = 0) -> torch.Tensor:
    """Sum of cross-entropy over ``targets`` that are not ``IGNORE_INDEX``; ``chunk``: tokens
    per chunk of the chunked loss (``train.loss_chunk``; 0: PyTorch's on the fp32 logits)."""
    return cross_entropy(logits, targets, chunk)


def plain_loss(t: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor (under ``loss_parallel`` it is a replicated DTensor)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def eval_batches(corpus: Corpus | HeldOut, wanted: int | None, batch: int, seq_len: int) -> int:
    """Global batches one evaluation runs: ``wanted`` (all when None), at most what the
    held-out data holds."""
    whole = corpus.windows(seq_len) // batch
    return whole if wanted is None else min(wanted, whole)


@torch.no_grad()
def evaluate(model: nn.Module, loss_context: Callable, corpus: Corpus | HeldOut, batches: int,
             batch: int, seq_len: int, micro: int, dp_rank: int, dp: int,
             device: torch.device, documents: bool = False, chunk: int = 0) -> tuple[float, float]:
    """(loss, perplexity) over ``batches`` global batches of held-out windows: the mean over
    every counted target of all of them, the same on any mesh. Collective. ``documents``:
    packed documents masked from each other, as in training."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # (loss sum, targets)
    for i in range(batches):
        b: Batch = corpus.eval_batch(i, batch, seq_len, dp_rank, dp) if isinstance(corpus, HeldOut) \
            else eval_batch(corpus, i, batch, seq_len, dp_rank, dp)
        tokens, mask = b.to(device)
        positions = None
        if documents and position_kwarg(model) is not None:  # a source's document starts, or the separator
            positions = b.positions.to(device) if b.positions is not None \
                else document_positions(tokens, corpus.separator)
        for m in range(0, len(tokens), micro):
            targets = tokens[m:m + micro, 1:]
            if mask is not None:
                targets = targets.masked_fill(~mask[m:m + micro], IGNORE_INDEX)
            # under context parallelism each cp rank adds its part of the sequence
            pos = None if positions is None else positions[m:m + micro, :-1]
            inputs, targets, kwargs = shard_batch(model, tokens[m:m + micro, :-1], targets, pos)
            with loss_context():
                s = target_loss(model(inputs, **kwargs), targets, chunk)
            total[0] += plain_loss(s).double()
            total[1] += (targets != IGNORE_INDEX).sum()
    # TP peers add the same sums as their dp rank: both totals grow alike, the ratio holds.
    dist.all_reduce(total)
    model.train(was_training)
    loss = float(total[0] / total[1].clamp(min=1))
    return loss, math.exp(min(loss, 700.0))


class Evaluation:
    """The ``eval`` section in a run: after which steps to evaluate, and the last result."""

    def __init__(self, prep, model: nn.Module, micro: int, dp_rank: int, device: torch.device):
        self.prep, self.model, self.micro, self.dp_rank, self.device = \
            prep, model, micro, dp_rank, device
        t, corpus = prep.plan.train, prep.eval_corpus
        self.batches = 0 if corpus is None else eval_batches(
            corpus, prep.plan.eval.batches, prep.step.global_batch, t.seq_len)
        self.last: dict[str, float] = {}

    def after(self, step: int) -> dict[str, float]:
        """``{eval_loss, eval_ppl}`` for the metrics row when ``step`` is due, else ``{}``.
        Collective: every rank calls it after every step."""
        plan = self.prep.plan
        t, interval = plan.train, plan.eval.interval
        if not self.batches or not (step == t.steps or (interval and step % interval == 0)):
            return {}
        loss, ppl = evaluate(self.model, plan.loss_context, self.prep.eval_corpus, self.batches,
                             self.prep.step.global_batch, t.seq_len, self.micro, self.dp_rank,
                             self.prep.dims.dp, self.device, plan.data.document_mask,
                             plan.train.loss_chunk)
        self.last = {"eval loss": loss, "eval perplexity": ppl}
        return {"eval_loss": loss, "eval_ppl": ppl}

    def summary(self) -> dict[str, float]:
        return dict(self.last)
