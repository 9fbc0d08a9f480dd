"""Packed documents through FlexAttention: a block mask built from the documents in place of
the dense ``(bs, 1, s, s)`` additive mask.

The dense mask costs ``bs × s²`` bytes and every score is computed then masked; a block mask
keeps, per 128 × 128 tile, whether it is empty, full or partial, so compiled FlexAttention
skips the tiles no document spans (most of them for short documents) and never holds the
mask. Used by the built-in Llama on CUDA inside a compiled block (eager FlexAttention
materializes the scores: the dense mask's kernel is better there); on CPU it runs eagerly
and equals the dense mask (``tests/test_fast_step.py``).
"""

from __future__ import annotations

import torch

__all__ = ["document_block_mask", "document_ids", "flex_document_attention", "use_flex"]


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """(bs, s) index of each token's packed document: a new one wherever a position does not
    continue its predecessor's (as :func:`tpplan.models.llama.document_mask` reads them)."""
    starts = positions[:, 1:] != positions[:, :-1] + 1
    return torch.cat([torch.zeros_like(positions[:, :1]), starts.long()], dim=1).cumsum(1)


_LAST: list = [None, None]  # (positions, block mask): every block of one forward shares them


def document_block_mask(positions: torch.Tensor):
    """The block-causal FlexAttention ``BlockMask`` of the documents in ``positions``, made
    once per forward (outside any compiled graph: :func:`flex_document_attention` calls it
    through ``torch.compiler.disable``, applied there because decorating here would import
    torch._dynamo, about a second, into every process that imports the Llama) and reused by
    every block."""
    from torch.nn.attention.flex_attention import create_block_mask

    if _LAST[0] is positions:
        return _LAST[1]
    docs = document_ids(positions)
    bs, s = docs.shape

    def same_document_causal(b, h, q, kv):
        return (docs[b, q] == docs[b, kv]) & (q >= kv)

    mask = create_block_mask(same_document_causal, bs, None, s, s, device=positions.device)
    _LAST[:] = [positions, mask]
    return mask


def flex_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            positions: torch.Tensor) -> torch.Tensor:
    """Causal attention of (bs, h, s, hd) queries on (bs, kv, s, hd) keys and values within
    each packed document of ``positions``: FlexAttention under :func:`document_block_mask`."""
    from torch.nn.attention.flex_attention import flex_attention

    mask = torch.compiler.disable(document_block_mask)(positions)
    return flex_attention(q, k, v, block_mask=mask, enable_gqa=True)


def use_flex(q: torch.Tensor) -> bool:
    """FlexAttention for packed documents where it is fast: CUDA, inside a compiled block."""
    return q.is_cuda and torch.compiler.is_compiling()
