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

from ..._torch.attention import cpu_flash_attention, cpu_flash_attention_backward

__all__ = ["document_ids", "one_document_per_row", "attention_mask", "sequence_mask", "additive", "ring_attention",
           "ulysses_attention", "causal_blocks", "ring_causal", "ulysses_causal"]

Kernel = Callable[..., torch.Tensor]  # (q, k, v, mask) -> (bs, h, s, hd)


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """(bs, S) positions in sequence order -> the document each token belongs to: a new one
    wherever the position does not continue the previous token's (the test transformers'
    ``find_packed_sequence_indices`` uses, so both models read packing the same way)."""
    starts = positions[:, 1:] != positions[:, :-1] + 1
    return torch.cat([torch.zeros_like(positions[:, :1]), starts.long()], dim=1).cumsum(1)


def one_document_per_row(positions: torch.Tensor) -> bool:
    """Every row one document (no boundary to mask): causal attention serves, no mask."""
    from ..._torch.fake import FakeTensor

    if isinstance(positions, FakeTensor):
        return False  # values unknown: masked, as a real run with documents would be
    return bool((document_ids(positions)[:, -1] == 0).all())


def attention_mask(q_index: torch.Tensor, k_index: torch.Tensor,
                   q_doc: torch.Tensor | None, k_doc: torch.Tensor | None) -> torch.Tensor:
    """(bs or 1, 1, sq, sk) boolean: key at or before the query, in the same document."""
    mask = (q_index[:, None] >= k_index[None, :])[None]
    if q_doc is not None:
        mask = mask & (q_doc[:, :, None] == k_doc[:, None, :])
    return mask[:, None]


def _gather(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    """All-gather over cp along ``dim``, differentiable (backward: a reduce-scatter)."""
    from ..._torch.collectives import all_gather_single_autograd

    return all_gather_single_autograd(t.contiguous(), dim, group)


def _gather_plain(t: torch.Tensor, group, cp: int) -> torch.Tensor:
    """Integer positions of every rank, concatenated along the sequence (no gradient)."""
    from ..._torch.collectives import all_gather_tensor

    return all_gather_tensor(t.contiguous(), 1, group)


def sequence_mask(index: torch.Tensor, all_index: torch.Tensor, positions: torch.Tensor,
                  group, cp: int, rank: int, queries: str, window: int | None = None,
                  chunk: int | None = None) -> torch.Tensor:
    """The boolean mask of one attention call, keys in rank order (every rank's tokens,
    rank 0's first), queries ``local`` (this rank's, for ring) or ``all`` (for Ulysses);
    ``window``/``chunk``: a local-attention layer's (:mod:`.local`).

    Documents are read from the positions of the whole sequence (gathered once, integers
    only): where a position does not continue its predecessor's, a new document starts."""
    from .local import local_mask

    every = _gather_plain(positions, group, cp)  # (bs, S) in rank order
    in_order = torch.empty_like(every)
    in_order[:, all_index] = every  # global order, where documents are contiguous
    docs = document_ids(in_order)[:, all_index]  # back to rank order
    q_index, q_docs, q_pos = all_index, docs, every
    if queries != "all":
        s = index.numel()
        here = slice(rank * s, (rank + 1) * s)
        q_index, q_docs, q_pos = index, docs[:, here], every[:, here]
    mask = attention_mask(q_index, all_index, q_docs, docs)
    local = local_mask(q_index, all_index, q_pos, every, window, chunk)
    return mask if local is None else mask & local


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as the float one SDPA adds to the scores (0 kept, -inf masked). Made
    once per forward and handed to every layer: SDPA turns a boolean mask into this itself,
    a new one per call, and saves each for backward (one ``sq × sk`` float per layer)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, float("-inf"))


def ring_attention(q, k, v, mask, group, kernel: Kernel,
                   keys: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's queries against every rank's keys and values (all-gathered over cp on
    the sequence dimension; their gradients reduce-scattered back in backward). ``keys``:
    the rank-order places of the only keys the queries can see (a sliding window's), the
    others left out of the kernel (``mask``'s columns are those keys')."""
    k, v = _gather(k, 2, group), _gather(v, 2, group)
    if keys is not None:
        k, v = k.index_select(2, keys), v.index_select(2, keys)
    return kernel(q, k, v, mask)


def _to_heads(t: torch.Tensor, cp: int, group) -> torch.Tensor:
    """(bs, h, s, hd) sequence shard -> (bs, h/cp, cp·s, hd) head shard, ranks' chunks in
    rank order: one all-to-all."""
    from ..._torch.collectives import all_to_all_single_autograd

    bs, h, s, hd = t.shape
    send = t.reshape(bs, cp, h // cp, s, hd).transpose(0, 1).contiguous()
    got = all_to_all_single_autograd(send, None, None, group)  # (cp: source rank, ...)
    return got.permute(1, 2, 0, 3, 4).reshape(bs, h // cp, cp * s, hd)


def _to_sequence(t: torch.Tensor, cp: int, group) -> torch.Tensor:
    """The inverse of :func:`_to_heads`: (bs, h/cp, cp·s, hd) -> (bs, h, s, hd)."""
    from ..._torch.collectives import all_to_all_single_autograd

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


def _flash(q, k, v, causal: bool, scale):
    return cpu_flash_attention(q, k, v, 0.0, causal, scale=scale)


def _flash_backward(grad, q, k, v, out, lse, causal: bool, scale):
    return cpu_flash_attention_backward(grad, q, k, v, out, lse, 0.0, causal, scale=scale)


class _CausalBlocks(torch.autograd.Function):
    """Causal attention of query chunks on keys in global order, with no mask: each chunk
    against the keys before it (unmasked) and its own chunk's (causal, the square kernel's
    diagonal), the two merged by log-sum-exp. Backward runs the kernel's own backward on
    each piece with the merged output and log-sum-exp, as flash attention does per block
    (and torch's ring attention per ring step), so the gradients are the one softmax's."""

    @staticmethod
    def forward(ctx, q, k, v, chunks, scale):
        out, lse = torch.empty_like(q), None
        for start, first, n in chunks:  # local start, global start, length
            qc = q[:, :, start:start + n]
            o, m = _flash(qc, k[:, :, first:first + n], v[:, :, first:first + n], True, scale)
            if first:
                o2, m2 = _flash(qc, k[:, :, :first], v[:, :, :first], False, scale)
                merged = torch.logaddexp(m, m2)
                o = (o.to(m.dtype) * (m - merged).exp()[..., None]
                     + o2.to(m.dtype) * (m2 - merged).exp()[..., None])
                m = merged
            if lse is None:  # the kernel's accumulation type (float32 for half types)
                lse = m.new_empty(q.shape[:3])
            out[:, :, start:start + n] = o
            lse[:, :, start:start + n] = m
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.chunks, ctx.scale = chunks, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        grad = grad.contiguous()
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for start, first, n in ctx.chunks:
            here = slice(start, start + n)
            g, qc, oc, mc = grad[:, :, here], q[:, :, here], out[:, :, here], lse[:, :, here]
            own = slice(first, first + n)
            a, b, c = _flash_backward(g, qc, k[:, :, own], v[:, :, own], oc, mc, True,
                                      ctx.scale)
            dq[:, :, here] += a
            dk[:, :, own] += b
            dv[:, :, own] += c
            if first:
                a, b, c = _flash_backward(g, qc, k[:, :, :first], v[:, :, :first], oc, mc,
                                          False, ctx.scale)
                dq[:, :, here] += a
                dk[:, :, :first] += b
                dv[:, :, :first] += c
        return dq, dk, dv, None, None


def causal_blocks(q, k, v, chunks: tuple[tuple[int, int, int], ...],
                  scale: float | None = None) -> torch.Tensor:
    """Causal attention of (bs, h, s, hd) local queries on (bs, kv, S, hd) keys and values of
    the whole sequence in global order, no mask built: ``chunks`` (local start, global
    start, length) place each run of local queries in the sequence. CPU's flash kernel,
    which returns the log-sum-exp the merge needs."""
    return _CausalBlocks.apply(q, k, v, chunks, scale)


def ring_causal(q, k, v, group, order: torch.Tensor, chunks, scale=None) -> torch.Tensor:
    """Ring attention without documents: K and V all-gathered and put in global order
    (``order``: the rank-order place of each global index), then :func:`causal_blocks`."""
    k, v = _gather(k, 2, group).index_select(2, order), _gather(v, 2, group).index_select(2, order)
    return causal_blocks(q, k, v, chunks, scale)


def ulysses_causal(q, k, v, group, cp: int, order: torch.Tensor,
                   all_index: torch.Tensor, scale=None) -> torch.Tensor:
    """Ulysses without documents: the head shards put in global order, causal attention on
    the square (no mask), back to rank order."""
    import torch.nn.functional as F

    q, k, v = (_to_heads(t, cp, group).index_select(2, order) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True,
                                         scale=scale)
    return _to_sequence(out.index_select(2, all_index), cp, group)
