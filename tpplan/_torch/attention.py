"""The CPU flash-attention kernel and SDPA's entry point.

Checked on torch 2.11 through 2.14.1: ``aten._scaled_dot_product_flash_attention_for_cpu``
(``(query, key, value, dropout_p, is_causal, *, attn_mask, scale) -> (output, logsumexp)``)
and its backward are the ops ``F.scaled_dot_product_attention`` runs on CPU.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

__all__ = ["cpu_flash_attention", "cpu_flash_attention_backward", "cpu_flash_ops", "sdpa_routed"]


def cpu_flash_ops() -> tuple[Any, Any]:
    """The CPU flash-attention op's forward and backward overloads (``.default``)."""
    aten = torch.ops.aten
    return (aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default)


def cpu_flash_attention(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(output, logsumexp)`` of the CPU flash-attention op."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*args, **kwargs)


def cpu_flash_attention_backward(*args: Any, **kwargs: Any) -> tuple:
    """``(grad_query, grad_key, grad_value)`` of the CPU flash-attention op."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(*args, **kwargs)


@contextlib.contextmanager
def sdpa_routed(route: Callable[[Callable], Callable]) -> Iterator[None]:
    """Within the block, ``torch.nn.functional.scaled_dot_product_attention`` is
    ``route(original)``: models that call it as ``F.scaled_dot_product_attention`` at run time
    get the routed one. Restored on exit."""
    sdpa = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = route(sdpa)
    try:
        yield
    finally:
        F.scaled_dot_product_attention = sdpa
