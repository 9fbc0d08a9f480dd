"""Local attention under context parallelism: sliding windows and chunks, over global indices.

A sliding-window layer lets a query see the ``window`` keys up to itself (transformers'
``sliding_window_overlay``: ``k > q - window``); a chunked one only keys of its own
``chunk``-token chunk (``chunked_overlay``: ``k // chunk == q // chunk``). Both are read on the
token's place in the whole sequence, which under cp is not its place on the rank, so the
window is one more term of the cp mask, built from the global indices of the layout.

Under ring each rank gathers every rank's keys, but a window leaves most of them unseen by
its queries: :func:`needed_keys` names, from the layout alone (integers, no data), the keys
any local query can see, and only those enter attention.

Chunks are counted from each packed document's start (transformers remaps the mask's indices
to the position ids when it finds packing), so the chunk term reads the tokens' positions.
"""

from __future__ import annotations

import torch

__all__ = ["Locality", "local_mask", "needed_keys", "LAYER_KINDS"]

# transformers' layer_types tpplan's cp mask builds; any other (linear attention, a
# convolution, a state-space layer) mixes tokens outside attention, where cp cannot see
LAYER_KINDS = ("full_attention", "sliding_attention", "chunked_attention")

Locality = tuple  # (window or None, chunk or None): the key of one mask per forward


def local_mask(q_index: torch.Tensor, k_index: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
               window: int | None, chunk: int | None) -> torch.Tensor | None:
    """(bs, 1, sq, sk) boolean of the keys the window and chunk let each query see (None:
    all): the window over global indices (``q_index``, ``k_index``), the chunk over
    positions (``q_pos`` (bs, sq), ``k_pos`` (bs, sk))."""
    mask = None
    if window:
        mask = ((q_index[:, None] - k_index[None, :]) < window)[None, None]
    if chunk:
        same = torch.div(q_pos, chunk, rounding_mode="floor")[:, :, None] == torch.div(
            k_pos, chunk, rounding_mode="floor")[:, None, :]
        mask = same[:, None] if mask is None else mask & same[:, None]
    return mask


def needed_keys(runs: tuple[tuple[int, int, int], ...], every: list[tuple[int, int, int]],
                window: int | None, chunk: int | None) -> list[int] | None:
    """The rank-order places of the keys some local query can see, or None for all of them.

    ``runs``: this rank's (local start, global start, length); ``every``: every rank's runs
    in rank order as (rank-order start, global start, length). A query at global ``g`` sees
    keys from ``g - window + 1`` (window) or its chunk's start (chunk) up to ``g``."""
    if not window and not chunk:
        return None
    ranges = []
    for _, first, n in runs:
        lo = 0
        if window:
            lo = max(lo, first - window + 1)
        if chunk:  # a chunk starts at most chunk - 1 tokens back (its start is the
            lo = max(lo, first - chunk + 1)  # document's place: packed ones restart it)
        ranges.append((lo, first + n - 1))
    keep = [start + g - first for start, first, n in every for g in range(first, first + n)
            if any(lo <= g <= hi for lo, hi in ranges)]
    total = sum(n for _, _, n in every)
    return None if len(keep) == total else keep
