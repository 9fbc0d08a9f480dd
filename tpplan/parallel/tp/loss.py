"""Cross-entropy in chunks of tokens: the full fp32 logits are never materialized.

``F.cross_entropy(logits.float())`` over a 128,256-word vocabulary makes, per micro-batch of
``N`` tokens, an fp32 copy of the logits, saves an fp32 log-softmax of the same size for
backward and makes an fp32 gradient in backward: three ``N × V × 4`` bytes, beside the
model's own (bf16) logits. At the 1B width that is more than the activations of a block.
:func:`cross_entropy` computes the same loss a chunk of ``chunk`` tokens at a time (upcast,
log-sum-exp, the target's logit), keeps only one fp32 number per token for backward (the
log-sum-exp) and recomputes each chunk's softmax in backward, writing the gradient in the
logits' own dtype. Equal to the plain loss up to fp32 rounding (summation order).

Under loss parallel the logits are vocabulary-sharded (a DTensor, ``Shard(-1)`` over tp): each
chunk's maximum and sum of exponentials are all-reduced over the tp group (a distributed
log-sum-exp) with the target's logit, which only its owner holds; backward needs no
collective (each rank's gradient is its shard of ``softmax - onehot``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

__all__ = ["CHUNKED_MIN_VOCAB", "IGNORE_INDEX", "cross_entropy"]

IGNORE_INDEX = -100
# Below this vocabulary the fp32 logits are small beside the activations: the plain loss runs.
CHUNKED_MIN_VOCAB = 32_768


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``logits`` (``N × V_local``) against ``targets`` (``N``), chunk
    by chunk; ``group``/``start``: the tp group and this rank's first vocabulary index when
    the vocabulary is sharded (else None and 0)."""

    @staticmethod
    def forward(ctx, logits, targets, chunk, group, start):  # noqa: D102
        n, v = logits.shape
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for s in range(0, n, chunk):
            x = logits[s:s + chunk].float()
            t = targets[s:s + chunk]
            m = x.amax(-1)
            if group is not None:
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            local = t - start
            owned = (local >= 0) & (local < v)
            picked = x.gather(1, local.clamp(0, v - 1)[:, None]).squeeze(1) * owned
            sums = torch.stack([(x - m[:, None]).exp().sum(-1), picked])
            del x
            if group is not None:
                dist.all_reduce(sums, group=group)
            lse[s:s + chunk] = m + sums[0].log()
            total += ((lse[s:s + chunk] - sums[1]) * (t != IGNORE_INDEX)).sum()
        ctx.save_for_backward(logits, targets, lse)
        ctx.chunk, ctx.start = chunk, start
        return total

    @staticmethod
    def backward(ctx, grad_total):  # noqa: D102
        logits, targets, lse = ctx.saved_tensors
        chunk, start = ctx.chunk, ctx.start
        n, v = logits.shape
        grad = torch.empty_like(logits)
        rows = torch.arange(min(chunk, n), device=logits.device)
        for s in range(0, n, chunk):
            t = targets[s:s + chunk]
            p = (logits[s:s + chunk].float() - lse[s:s + chunk, None]).exp()
            local = t - start
            owned = (local >= 0) & (local < v)
            k = len(t)
            p[rows[:k], local.clamp(0, v - 1)] -= owned.to(p.dtype)
            p *= ((t != IGNORE_INDEX).to(p.dtype) * grad_total)[:, None]
            grad[s:s + chunk] = p
        return grad, None, None, None, None


def _vocab_shard(logits: DTensor):
    """(local logits, tp group, first vocabulary index) where ``logits`` are sharded over the
    vocabulary on a 1-D mesh; None for any other layout (the plain loss takes those)."""
    mesh, placements = logits.device_mesh, logits.placements
    if mesh.ndim != 1 or len(placements) != 1 or not isinstance(placements[0], Shard):
        return None
    if placements[0].dim % logits.ndim != logits.ndim - 1:
        return None
    # torch.chunk's split (DTensor's Shard): ceil(V / n) a rank, the last ones shorter
    per_rank = -(-logits.shape[-1] // mesh.size())
    local = logits.to_local()
    return local, mesh.get_group(), mesh.get_local_rank() * per_rank


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, chunk: int = 0,
                  reduction: str = "sum") -> torch.Tensor:
    """Cross-entropy of ``logits`` (``batch × seq × vocab``, or vocabulary-sharded under loss
    parallel) against ``targets``, ignoring ``IGNORE_INDEX``: ``reduction`` ``sum`` or
    ``mean`` (over the targets that count). ``chunk``: tokens per chunk; 0, or a vocabulary
    under :data:`CHUNKED_MIN_VOCAB`, runs PyTorch's own loss on the fp32 logits.

    Example::

        >>> logits = torch.randn(2, 8, 40_000, requires_grad=True)
        >>> targets = torch.randint(0, 40_000, (2, 8))
        >>> loss = cross_entropy(logits, targets, chunk=4)  # == F.cross_entropy(..., reduction="sum")
    """
    flat_targets = targets.flatten()
    if chunk <= 0 or logits.shape[-1] < CHUNKED_MIN_VOCAB:
        return F.cross_entropy(logits.flatten(0, 1).float(), flat_targets,
                               ignore_index=IGNORE_INDEX, reduction=reduction)
    if isinstance(flat_targets, DTensor):
        flat_targets = flat_targets.full_tensor()
    group, start = None, 0
    if isinstance(logits, DTensor):
        shard = _vocab_shard(logits)
        if shard is None:
            return F.cross_entropy(logits.flatten(0, 1).float(), flat_targets,
                                   ignore_index=IGNORE_INDEX, reduction=reduction)
        logits, group, start = shard
    total = _ChunkedCrossEntropy.apply(logits.flatten(0, -2), flat_targets, chunk, group, start)
    if reduction == "mean":
        return total / (flat_targets != IGNORE_INDEX).sum().clamp(min=1)
    return total
