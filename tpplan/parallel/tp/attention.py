"""Attention computed on DTensors, on CPU and on the meta device.

A model may run its attention on DTensors (colwise q/k/v with ``use_local_output: false``,
as PyTorch's own TP examples do) instead of local tensors. On CUDA that works: DTensor
knows how to shard the fused flash and memory-efficient kernels. On CPU, PyTorch's SDPA
picks ``_scaled_dot_product_flash_attention_for_cpu``, which DTensor has no rule for
(``NotImplementedError ... does not have a sharding strategy``); on the meta device (the
dry run) SDPA falls back to its math decomposition, which adds a plain causal mask to a
DTensor (``aten.add.Tensor got mixed torch.Tensor and DTensor``). tpplan gives the CPU
kernel and its backward the same sharding the CUDA kernels have (every tensor replicated,
or all sharded on batch, or all sharded on heads), and in the dry run sends SDPA on meta
DTensors to that kernel, as a real CPU run does.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

from ..._torch.attention import cpu_flash_attention, cpu_flash_ops, sdpa_routed

__all__ = ["register_cpu_attention", "fused_attention_on_meta"]


def _shardings(outputs: int, tensors: int, others: int) -> list[tuple[list, list]]:
    """Every tensor replicated, or every tensor sharded on batch (0) or heads (1)."""
    from torch.distributed.tensor import Replicate, Shard

    choices = []
    for p in (Replicate(), Shard(0), Shard(1)):
        choices.append(([p] * outputs, [p] * tensors + [None] * others))
    return choices


@functools.cache
def register_cpu_attention() -> None:
    """Teach DTensor the CPU flash-attention kernel and its backward (once per process).

    Only the attention-mask-free call is covered (a causal flag, as decoder models use): a
    mask given as a tensor makes the op's inputs ones this rule does not describe, and
    DTensor then says so itself."""
    from torch.distributed.tensor.experimental import register_sharding

    forward, backward = cpu_flash_ops()

    @register_sharding(forward)
    def _forward(query, key, value, dropout_p=0.0, is_causal=False, **kwargs):
        # (output, logsumexp) from (query, key, value, dropout_p, is_causal)
        return _shardings(2, 3, 2)

    @register_sharding(backward)
    def _backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal,
                  **kwargs):
        # (grad_query, grad_key, grad_value) from the six tensors, dropout_p, is_causal
        return _shardings(3, 6, 2)


@contextlib.contextmanager
def fused_attention_on_meta() -> Iterator[None]:
    """Within the block, SDPA on meta DTensors runs the CPU fused kernel (and its
    backward), as the same call does on a real CPU mesh; every other call is untouched."""
    from torch.distributed.tensor import DTensor

    register_cpu_attention()

    def route(sdpa: Callable) -> Callable:
        def routed(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                   scale=None, **kwargs):
            if (attn_mask is None and not kwargs and isinstance(query, DTensor)
                    and query.device.type == "meta"):
                out, _ = cpu_flash_attention(query, key, value, dropout_p, is_causal, scale=scale)
                return out
            return sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                        is_causal=is_causal, scale=scale, **kwargs)
        return routed

    with sdpa_routed(route):
        yield
