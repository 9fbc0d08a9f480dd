"""Context parallelism: each ``cp`` rank holds part of every sequence (docs/long-context.md).

The cp ranks of one data-parallel slot take the same batch; :func:`shard_batch` gives each
its tokens, targets and rotary positions, and the model's attention, wrapped by
:func:`apply_context_parallel`, sees the whole sequence through the method's collectives
(:mod:`.attention`). Everything outside attention is per token, so it runs on the
local tokens unchanged; FSDP2 shards parameters over ``dp_shard × cp`` and reduces their
gradients over both (each rank's loss is the mean over its own tokens, all ranks hold as
many, so the average is the whole batch's mean).

With ``load_balance`` the sequence is cut into ``2·cp`` chunks and rank r holds chunks r
and ``2·cp - 1 - r`` (torchtitan's head-tail order): under a causal mask the early chunks
have few keys and the late ones many, so each rank gets one of each.

Two attention seams are wrapped: the built-in Llama's ``Attention.attend(q, k, v, positions)`` and a
HuggingFace model's attention interface (its config's, set to a registered function that calls the model's own).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..._torch.fake import is_fake
from ...plan.errors import ErrorList
from ...plan.context import ContextParallelSpec
from ...plan.specs import PlanSpec
from .attention import (additive, one_document_per_row, ring_attention, ring_causal,
                        sequence_mask, ulysses_attention, ulysses_causal)
from .hf import HF_ATTENTION, hf_config, unsupported_layers, wrap_hf
from .local import needed_keys

__all__ = ["ContextParallel", "sequence_index", "apply_context_parallel", "shard_batch",
           "position_kwarg", "check_context_parallel", "attention_shape", "HF_ATTENTION"]


def runs(local: int, cp: int, rank: int, load_balance: bool) -> tuple[tuple[int, int, int], ...]:
    """Rank ``rank``'s runs of ``local`` tokens as (local start, global start, length)."""
    if not load_balance:
        return ((0, rank * local, local),)
    size = local // 2  # chunks r and 2·cp - 1 - r, as sequence_index cuts them
    return ((0, rank * size, size), (size, (2 * cp - 1 - rank) * size, size))


def sequence_index(seq_len: int, cp: int, rank: int, load_balance: bool) -> torch.Tensor:
    """(seq_len / cp,) the places in the whole sequence of rank ``rank``'s tokens."""
    if not load_balance:
        c = seq_len // cp
        return torch.arange(rank * c, (rank + 1) * c)
    c = seq_len // (2 * cp)
    tail = 2 * cp - 1 - rank
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange(tail * c, (tail + 1) * c)])


def _sdpa(q, k, v, mask, scale=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=scale)


class ContextParallel:
    """One model's context parallelism: the cp group, the method and the sequence layout.

    The mask depends only on the positions (and the layout), so it is built once per forward
    and reused by every layer (and by activation checkpointing's recompute)."""

    def __init__(self, mesh, spec: ContextParallelSpec, position_kwarg: str):
        self.mesh, self.method, self.load_balance = mesh, spec.method, spec.load_balance
        self.group, self.cp, self.rank = mesh.get_group(), mesh.size(), mesh.get_local_rank()
        self.position_kwarg = position_kwarg
        self._mask_for: tuple[Any, dict] | None = None
        self._causal: torch.Tensor | None = None  # positions shard_batch found undivided
        self._given: torch.Tensor | None = None  # the last positions shard_batch gave
        self._layouts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def layout(self, local: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's global indices, every rank's in rank order) for ``local`` tokens."""
        if local not in self._layouts:
            total = local * self.cp
            every = [sequence_index(total, self.cp, r, self.load_balance) for r in range(self.cp)]
            self._layouts[local] = (every[self.rank], torch.cat(every))
        return self._layouts[local]

    def shard(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part of a whole-sequence tensor (``dim`` the sequence)."""
        index, _ = self.layout(t.shape[dim] // self.cp)
        return t.index_select(dim, index.to(t.device))

    def unshard(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The whole sequence from every rank's part (no gradient): the inverse of
        :meth:`shard`, for logits that are compared or saved."""
        import torch.distributed as dist

        parts = [torch.empty_like(t) for _ in range(self.cp)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        _, all_index = self.layout(t.shape[dim])
        out = torch.empty_like(torch.cat(parts, dim))
        out.index_copy_(dim, all_index.to(t.device), torch.cat(parts, dim))
        return out

    def chunks(self, local: int) -> tuple[tuple[int, int, int], ...]:
        """This rank's runs of tokens as (local start, global start, length)."""
        return runs(local, self.cp, self.rank, self.load_balance)

    def _keys(self, local: int, window: int | None, chunk: int | None, device) -> torch.Tensor | None:
        """Ring under a window or chunks: the rank-order places of the gathered keys some
        local query can see (None: every key), from the layout alone."""
        every = [(r * local + start, first, n) for r in range(self.cp)
                 for start, first, n in runs(local, self.cp, r, self.load_balance)]
        keep = needed_keys(self.chunks(local), every, window, chunk)
        return None if keep is None else torch.tensor(keep, device=device)

    def _mask(self, positions, index, all_index, dtype, window, chunk, keys) -> torch.Tensor:
        """The additive mask of this forward for one locality (window, chunk): built once
        per forward and kind of layer, shared by every such layer (``keys``: its columns)."""
        if self._mask_for is None or self._mask_for[0] is not positions:
            self._mask_for = (positions, {})
        masks = self._mask_for[1]
        if (window, chunk, "bool") not in masks:
            queries = "local" if self.method == "ring" else "all"
            mask = sequence_mask(index, all_index, positions, self.group, self.cp, self.rank,
                                 queries, window, chunk)
            masks[(window, chunk, "bool")] = mask if keys is None else mask.index_select(-1, keys)
        if (window, chunk, dtype) not in masks:  # SDPA would turn a boolean mask to this per call
            masks[(window, chunk, dtype)] = additive(masks[(window, chunk, "bool")], dtype)
        return masks[(window, chunk, dtype)]

    def _undivided(self, positions: torch.Tensor, index: torch.Tensor) -> bool:
        """One document per row: the positions :func:`shard_batch` found so, or (a pipeline's
        micro-batches are new tensors) this rank's global indices by value, where known."""
        if positions is self._causal or positions.device.type == "meta" or is_fake(positions):
            return positions is self._causal
        return positions.shape[-1] == index.numel() and bool((positions == index).all())

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor | None, kernel=None, scale: float | None = None,
               window: int | None = None, chunk: int | None = None) -> torch.Tensor:
        """(bs, h, s, hd) queries of this rank's tokens against the whole sequence.

        Without packed documents (the positions :func:`shard_batch` made, or given ones
        with no boundary) the built-in attention builds no mask: causal attention in
        blocks (:func:`.attention.ring_causal`, ``ulysses_causal``). With
        documents, or a model's own ``kernel(q, k, v, mask)``, one mask per forward, shared
        by every layer. ``kernel`` None: softmax attention (SDPA), scores times ``scale``.
        ``window``/``chunk``: a sliding-window or chunked layer (.local), part of its mask;
        under ring only the gathered keys its queries can see enter the kernel."""
        from torch.distributed.tensor import DTensor

        if positions is None:  # an attention not handed them (Llama 4's): the batch's
            positions = self._given
        if positions is None:
            raise RuntimeError("context parallelism needs each token's position: take the "
                               "batch through tpplan.parallel.context.sequence.shard_batch")
        if isinstance(q, DTensor):
            raise RuntimeError("context parallelism runs attention on local tensors: give the "
                               "q/k/v projections use_local_output: true (the default)")
        index, all_index = self.layout(q.shape[2])
        index, all_index = index.to(q.device), all_index.to(q.device)
        local = window or chunk
        if kernel is None and not local and self._undivided(positions, index) and q.device.type in ("cpu", "meta"):
            order = torch.empty_like(all_index)
            order[all_index] = torch.arange(all_index.numel(), device=q.device)
            if self.method == "ring":
                return ring_causal(q, k, v, self.group, order, self.chunks(q.shape[2]), scale)
            return ulysses_causal(q, k, v, self.group, self.cp, order, all_index, scale)
        if kernel is None:
            kernel = functools.partial(_sdpa, scale=scale)
        keys = self._keys(q.shape[2], window, chunk, q.device) if local and self.method == "ring" else None
        mask = self._mask(positions, index, all_index, q.dtype, window, chunk, keys)
        if self.method == "ring":
            return ring_attention(q, k, v, mask, self.group, kernel, keys)
        return ulysses_attention(q, k, v, mask, self.group, self.cp, kernel)


def _seams(model: nn.Module) -> list[nn.Module]:
    """Modules with an ``attend(q, k, v, positions)`` seam (the built-in Llama's attention)."""
    return [m for m in model.modules() if callable(getattr(type(m), "attend", None))]


def position_kwarg(model: nn.Module) -> str | None:
    """The keyword the model takes per-token positions under: ``positions`` (built-in),
    ``position_ids`` (HF), None when it takes none."""
    if hf_config(model) is not None:
        return "position_ids"
    return "positions" if _seams(model) else None


def apply_context_parallel(model: nn.Module, mesh, spec: ContextParallelSpec) -> ContextParallel:
    """Wrap the model's attention for the cp sub-mesh ``mesh``; the returned object is also
    ``model.context_parallel`` (what :func:`shard_batch` reads)."""
    config = hf_config(model)
    ctx = ContextParallel(mesh, spec, position_kwarg(model) or "positions")
    if config is not None:
        wrap_hf(model, ctx)
    else:
        for m in _seams(model):
            m.attend = functools.partial(_seam_attend, ctx)
    model.context_parallel = ctx
    return ctx


def _seam_attend(ctx: ContextParallel, q, k, v, positions=None):
    return ctx.attend(q, k, v, positions)


def shard_batch(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                positions: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``(inputs, targets, kwargs)`` for this rank: ``model(inputs, **kwargs)``, then the
    loss against ``targets``. Under context parallelism the rank's part of the sequence and
    its global positions; ``positions`` (bs, S) restarting at 0 per packed document keep
    documents apart (with or without cp). Without either it is the batch as given."""
    ctx: ContextParallel | None = getattr(model, "context_parallel", None)
    if ctx is None:
        if positions is None:
            return inputs, targets, {}
        name = position_kwarg(model)
        if name is None:
            raise ValueError(f"{type(model).__name__} takes no per-token positions, so packed "
                             "documents cannot be masked from each other")
        return inputs, targets, {name: positions}
    one_document = positions is None or one_document_per_row(positions)
    if positions is None:
        positions = torch.arange(inputs.shape[1], device=inputs.device).expand(inputs.shape[0], -1)
    local = ctx.shard(positions)
    ctx._causal = local if one_document else None
    ctx._given = local
    return ctx.shard(inputs), ctx.shard(targets), {ctx.position_kwarg: local}


def check_context_parallel(plan: PlanSpec, model: nn.Module, tp: int, errs: ErrorList) -> None:
    """What the model must offer for ``mesh.cp``: an attention tpplan can wrap, only
    attention layers (full, sliding-window, chunked) mixing tokens, heads that divide over
    cp under Ulysses, and FSDP to reduce the gradients."""
    cp, spec = plan.mesh.cp, plan.context_parallel
    if cp <= 1:
        return
    where = spec.loc or plan.mesh.locs.get("cp") or plan.mesh.loc
    if plan.fsdp is None:
        errs.add(f"mesh cp={cp} needs an 'fsdp' section: the cp ranks hold the same parameters "
                 "and their gradients must be reduced (FSDP2 shards over dp_shard × cp); add "
                 "'fsdp: {}' at least", plan.mesh.locs.get("cp") or plan.mesh.loc)
    config = hf_config(model)
    if config is None and not _seams(model):
        errs.add(f"context parallelism cannot wrap {type(model).__name__}'s attention: tpplan "
                 "wraps the built-in Llama's Attention.attend(q, k, v, positions) and a "
                 "HuggingFace model's attention interface; give the model one of those", where)
        return
    other = unsupported_layers(config) if config is not None else []
    if other:
        errs.add(f"context parallelism does not support {type(model).__name__}'s "
                 f"{', '.join(other)} layers: they mix tokens outside the attention function, "
                 "which is all cp wraps (full, sliding-window and chunked attention are "
                 "supported)", where)
    if spec.method == "ulysses":
        heads = _heads(model, config)
        for name, n in heads:
            local = n // tp if n >= tp else 1
            if local % cp:
                errs.add(f"ulysses with cp={cp}: {name}={n} leaves {local} per tp rank "
                         f"(tp={tp}), which cp does not divide (each cp rank takes a slice of "
                         "the heads); use method: ring, or a cp that divides it",
                         spec.locs.get("method") or where)


def attention_shape(model: nn.Module) -> tuple[int, int, int, int]:
    """(attention layers, query heads, KV heads, head dim) of a model cp can wrap, before
    tensor parallelism divides the heads."""
    config = hf_config(model)
    (_, h), (_, kv) = _heads(model, config)
    if config is not None:
        d = getattr(config, "head_dim", None) or config.hidden_size // h
        return config.num_hidden_layers, h, kv, d
    seams = _seams(model)
    return len(seams), h, kv, seams[0].head_dim


def _heads(model: nn.Module, config) -> list[tuple[str, int]]:
    if config is not None:
        q = config.num_attention_heads
        return [("num_attention_heads", q),
                ("num_key_value_heads", getattr(config, "num_key_value_heads", None) or q)]
    m = _seams(model)[0]
    return [("n_heads", m.n_heads), ("n_kv_heads", m.n_kv_heads)]
