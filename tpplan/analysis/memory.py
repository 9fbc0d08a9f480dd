"""Memory per rank: parameters, gradients, optimizer state, FSDP working set, activations.

Parameter bytes are read from the real local shards of the applied meta model (rank 0 of
the fake mesh, which holds the largest shard when a dimension does not divide evenly).
The rest are formulas, each written out with its source in docs/dry-run.md.
"""

from __future__ import annotations

import math
from typing import Any

import torch.nn as nn

from ..parallel.fsdp_units import UnitSize
from ..parallel.resolve import Resolution
from ..plan.specs import PlanSpec, torch_dtype
from ..plan.step import StepShape

__all__ = ["memory_per_rank", "activation_bytes"]

ADAM_MOMENTS = 2  # AdamW keeps exp_avg and exp_avg_sq, fp32, shaped like the local shard
FP32 = 4


def _local(p):
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


def activation_bytes(model: nn.Module, plan: PlanSpec, res: Resolution,
                     shape: StepShape) -> int | None:
    """Activations saved for backward in one micro-batch, for a Llama-shaped model.

    Korthikanti et al. 2022's per-layer count, redone for a Llama block (RMSNorm, GQA,
    SwiGLU, fused attention, no dropout); returns None when the model has no ``config``
    with ``dim``, ``n_heads``, ``n_kv_heads``, ``hidden_dim``, ``n_layers``, ``vocab_size``.
    """
    cfg = getattr(model, "config", None)
    try:
        h, heads, kv = cfg.dim, cfg.n_heads, cfg.n_kv_heads
        f, layers, vocab = cfg.hidden_dim, cfg.n_layers, cfg.vocab_size
    except AttributeError:
        return None
    t = res.dims.tp
    sp = t if plan.uses_sequence_parallel else 1
    hk = kv * (h // heads)
    sb = shape.seq_len * shape.micro_batch
    e = torch_dtype(shape.param_dtype).itemsize
    # Two norm inputs (sharded by SP), the two gathered inputs of the colwise groups
    # (autograd saves the gathered tensor, so not divided), q/k/v and roped q/k, attention
    # output, and the four SwiGLU intermediates (w1 out, w3 out, silu, product) on tp shards.
    layer = sb * (2 * h / sp + 2 * h + (3 * h + 3 * hk + 4 * f) / t) * e
    block_input = sb * h / sp * e
    ac = plan.activation_checkpointing
    checkpointed = math.ceil(len(res.ac_blocks) / ac.every) if ac.enabled else 0
    stored = checkpointed * block_input + (layers - checkpointed) * layer
    recompute = layer if checkpointed else 0  # one block re-runs its forward at a time
    vocab_shard = t if plan.loss_parallel else 1
    head = sb * (h / sp + h) * e  # final norm input, head input (gathered)
    logits = sb * vocab / vocab_shard * (e + FP32 + FP32)  # logits, fp32 copy, log-softmax
    return int(stored + recompute + head + logits)


def memory_per_rank(model: nn.Module, plan: PlanSpec, res: Resolution, shape: StepShape,
                    units: list[UnitSize]) -> dict[str, Any]:
    """Bytes per rank, by part, and their ``total``; ``units`` are the plan's FSDP units."""
    local_elems = 0  # trained (not frozen) parameters' elements: AdamW keeps state for these
    params = grads = 0
    for p in model.parameters():
        t = _local(p)
        params += t.numel() * t.element_size()
        if p.requires_grad:
            local_elems += t.numel()
            grads += t.numel() * t.element_size()  # FSDP2: sharded, in the parameter's dtype
    optimizer = ADAM_MOMENTS * FP32 * local_elems
    working = 0
    if plan.fsdp is not None:
        largest = max((u.elements for u in units), default=0)
        prefetch = 2 if len(units) > 1 else 1  # FSDP2 gathers the next unit in backward early
        working = prefetch * largest * torch_dtype(shape.param_dtype).itemsize
    acts = activation_bytes(model, plan, res, shape)
    out = dict(parameters=params, gradients=grads, optimizer=optimizer,
               fsdp_unsharded=working, activations=acts)
    out["total"] = sum(v for v in out.values() if v is not None)
    out["batch"] = dict(seq_len=shape.seq_len, micro_batch_size=shape.micro_batch,
                        grad_accum=shape.grad_accum, compute_dtype=shape.param_dtype)
    return out
