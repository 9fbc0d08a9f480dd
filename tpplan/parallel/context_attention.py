"""Attention over a sequence split across the ``cp`` ranks: ring (K/V all-gathered) and
Ulysses (all-to-all to head shards), written with differentiable ``torch.distributed``
collectives so they run on a gloo CPU mesh as on NCCL, around any attention kernel.

Why not ``torch.distributed.tensor.experimental.context_parallel``: on CPU its ring has no
sharding strategy for ``aten._scaled_dot_product_flash_attention_for_cpu`` (torch 2.13 raises
``NotImplementedError``), and its masks are causal only, so packed documents cannot be kept
apart. The all-gather form is the Llama 3 paper's (Dubey et al. 2024, §3.3.2): each rank's
queries against the whole sequence's keys and values, the mask built from global token
indices, so causality, load balancing and document boundaries are one boolean mask, and
the result equals one device's attention (the same softmax over the same keys).

Shapes: ``q`` (bs, h, s, hd), ``k``/``v`` (bs, kv, s, hd), ``s`` this rank's tokens;
``positions`` (bs, s) the rotary position of each local token (restarting at 0 where a
packed document starts), ``index`` (s,) each local token's place in the whole sequence.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["document_ids", "attention_mask", "sequence_mask", "ring_attention",
           "ulysses_attention"]

Kernel = Callable[..., torch.Tensor]  # (q, k, v, mask) -> (bs, h, s, hd)


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """(bs, S) positions in sequence order -> the document each token belongs to: a new one
    wherever the position does not continue the previous token's (the test transformers'
    ``find_packed_sequence_indices`` uses, so both models read packing the same way)."""
    starts = positions[:, 1:] != positions[:, :-1] + 1
    return torch.cat([torch.zeros_like(positions[:, :1]), starts.long()], dim=1).cumsum(1)


def attention_mask(q_index: torch.Tensor, k_index: torch.Tensor,
                   q_doc: torch.Tensor | None, k_doc: torch.Tensor | None) -> torch.Tensor:
    """(bs or 1, 1, sq, sk) boolean: key at or before the query, in the same document."""
    mask = (q_index[:, None] >= k_index[None, :])[None]
    if q_doc is not None:
        mask = mask & (q_doc[:, :, None] == k_doc[:, None, :])
    return mask[:, None]


def _gather(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    """All-gather over cp along ``dim``, differentiable (backward: a reduce-scatter)."""
    from torch.distributed._functional_collectives import all_gather_single_autograd

    return all_gather_single_autograd(t.contiguous(), dim, group)


def _gather_plain(t: torch.Tensor, group, cp: int) -> torch.Tensor:
    """Integer positions of every rank, concatenated along the sequence (no gradient)."""
    from torch.distributed._functional_collectives import all_gather_tensor

    return all_gather_tensor(t.contiguous(), 1, group)


def sequence_mask(index: torch.Tensor, all_index: torch.Tensor, positions: torch.Tensor,
                  group, cp: int, rank: int, queries: str) -> torch.Tensor:
    """The boolean mask of one attention call, keys in rank order (every rank's tokens,
    rank 0's first), queries ``local`` (this rank's, for ring) or ``all`` (for Ulysses).

    Documents are read from the positions of the whole sequence (gathered once, integers
    only): where a position does not continue its predecessor's, a new document starts."""
    every = _gather_plain(positions, group, cp)  # (bs, S) in rank order
    in_order = torch.empty_like(every)
    in_order[:, all_index] = every  # global order, where documents are contiguous
    docs = document_ids(in_order)[:, all_index]  # back to rank order
    if queries == "all":
        return attention_mask(all_index, all_index, docs, docs)
    s = index.numel()
    return attention_mask(index, all_index, docs[:, rank * s:(rank + 1) * s], docs)


def ring_attention(q, k, v, mask, group, kernel: Kernel) -> torch.Tensor:
    """This rank's queries against every rank's keys and values (all-gathered over cp on
    the sequence dimension; their gradients reduce-scattered back in backward)."""
    return kernel(q, _gather(k, 2, group), _gather(v, 2, group), mask)


def _to_heads(t: torch.Tensor, cp: int, group) -> torch.Tensor:
    """(bs, h, s, hd) sequence shard -> (bs, h/cp, cp·s, hd) head shard, ranks' chunks in
    rank order: one all-to-all."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    bs, h, s, hd = t.shape
    send = t.reshape(bs, cp, h // cp, s, hd).transpose(0, 1).contiguous()
    got = all_to_all_single_autograd(send, None, None, group)  # (cp: source rank, ...)
    return got.permute(1, 2, 0, 3, 4).reshape(bs, h // cp, cp * s, hd)


def _to_sequence(t: torch.Tensor, cp: int, group) -> torch.Tensor:
    """The inverse of :func:`_to_heads`: (bs, h/cp, cp·s, hd) -> (bs, h, s, hd)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    bs, hl, total, hd = t.shape
    s = total // cp
    send = t.reshape(bs, hl, cp, s, hd).permute(2, 0, 1, 3, 4).contiguous()
    got = all_to_all_single_autograd(send, None, None, group)  # (cp: head group, ...)
    return got.transpose(0, 1).reshape(bs, cp * hl, s, hd)


def ulysses_attention(q, k, v, mask, group, cp: int, kernel: Kernel) -> torch.Tensor:
    """All-to-all from sequence shards to head shards, attention over the whole sequence
    on ``h/cp`` heads (any kernel), all-to-all back (DeepSpeed-Ulysses, Jacobs et al. 2023).
    Rank r takes query heads and KV heads of the same r-th slice, so grouped queries keep
    their KV head."""
    out = kernel(_to_heads(q, cp, group), _to_heads(k, cp, group), _to_heads(v, cp, group),
                 mask)
    return _to_sequence(out, cp, group)
