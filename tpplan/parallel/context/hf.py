"""A HuggingFace model's attention under context parallelism: a registered attention
function that runs the model's own (sdpa, eager, ...) as the kernel, with tpplan's cp mask in
place of the one the model built for the rank's tokens alone.

What each layer asks for is read where transformers says it: ``sliding_window`` among the
attention call's keywords (None on a full layer of a mixed model), ``chunked_attention``
among ``config.layer_types`` (with ``attention_chunk_size``). Soft-capping (Gemma 2's
``softcap``) and sinks (GPT-OSS's ``module.sinks``) stay the model's kernel's own work: it
applies the cap to the scores before adding the mask, and the sinks as one more logit per
row, so they need only the right heads (Ulysses: this rank's slice).
"""

from __future__ import annotations

import sys
from typing import Any

import torch.nn as nn

from ..._torch.transformers import attn_implementation, has_attn_implementation, set_attn_implementation
from .local import LAYER_KINDS

__all__ = ["HF_ATTENTION", "hf_config", "wrap_hf", "unsupported_layers"]

HF_ATTENTION = "tpplan_context_parallel"  # the name registered with transformers

_HF_CONTEXTS: dict[int, tuple[Any, Any, str]] = {}
_PLAIN = {"dropout", "scaling", "use_cache", "cache_position"}  # keywords that change nothing


def hf_config(model: nn.Module):
    """The model's transformers config, or None for a model that is not transformers'."""
    config = getattr(model, "config", None)
    return config if has_attn_implementation(config) else None


def _chunk(module, config) -> int | None:
    types = getattr(config, "layer_types", None)
    index = getattr(module, "layer_idx", None)
    if types and index is not None and types[index] == "chunked_attention":
        return getattr(config, "attention_chunk_size", None)
    return None


def _eager(module: nn.Module):
    """The model's own eager attention (``eager`` is no registered interface: each modeling
    file defines it, with the family's soft cap or sinks), Llama's where the file has none."""
    own = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if own is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward as own
    return own


class _HeadSlice:
    """The attention module as a kernel on a Ulysses head shard sees it: its sinks (one per
    head) cut to this rank's slice of the heads, everything else the module's own."""

    def __init__(self, module: nn.Module, cp: int, rank: int):
        self._module = module
        self.sinks = module.sinks.chunk(cp)[rank]

    def __getattr__(self, name: str):
        return getattr(self._module, name)


def _hf_attention(module, query, key, value, attention_mask, **kwargs):
    """The function transformers calls for each attention under context parallelism: the
    model's own implementation (sdpa, eager, ...) as the kernel, our mask in place of its."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config, ctx, inner_name = _HF_CONTEXTS[id(module.config)]  # config: the model's
    inner = ALL_ATTENTION_FUNCTIONS.get_interface(inner_name, _eager(module))
    positions = kwargs.pop("position_ids", None)
    window = kwargs.get("sliding_window")
    chunk = _chunk(module, config)
    seen = module
    if ctx.method == "ulysses" and getattr(module, "sinks", None) is not None:
        seen = _HeadSlice(module, ctx.cp, ctx.rank)

    def kernel(q, k, v, mask):  # mask: additive, as transformers' kernels take it
        out, _ = inner(seen, q, k, v, mask, **kwargs)
        return out.transpose(1, 2)  # transformers returns (bs, s, h, hd)

    # transformers' sdpa with nothing but a scale (no window, soft cap, sinks) is softmax
    # attention: ours serves, without a mask
    given = {k for k, v in kwargs.items() if v is not None}  # sliding_window=None: no window
    plain = (inner_name == "sdpa" and not kwargs.get("dropout") and not given - _PLAIN
             and chunk is None and getattr(module, "sinks", None) is None)
    out = ctx.attend(query, key, value, positions, None if plain else kernel,
                     kwargs.get("scaling"), window=window, chunk=chunk)
    return out.transpose(1, 2).contiguous(), None


def wrap_hf(model: nn.Module, ctx) -> None:
    """Route the model's attention through ``ctx``: its config's implementation, and that of
    every per-module copy of the config (tensor parallelism's packed styles give Phi-3's
    attention one with its heads per rank) read by the attention it belongs to."""
    from transformers import AttentionInterface

    AttentionInterface.register(HF_ATTENTION, _hf_attention)
    config = hf_config(model)
    configs = {id(config): config}
    for m in model.modules():
        c = getattr(m, "config", None)
        if c is not config and has_attn_implementation(c):
            configs.setdefault(id(c), c)
    for c in configs.values():
        inner = attn_implementation(c) or "sdpa"
        if inner == HF_ATTENTION:  # applied twice (verify's reference build is separate)
            inner = _HF_CONTEXTS[id(c)][2]
        _HF_CONTEXTS[id(c)] = (config, ctx, inner)  # configs kept: their ids stay unique
        set_attn_implementation(c, HF_ATTENTION)


def unsupported_layers(config) -> list[str]:
    """The kinds of ``config.layer_types`` that are not attention tpplan's cp mask builds
    (full, sliding-window, chunked): linear attention, convolutions, state-space layers mix
    tokens outside the attention function, which cp alone wraps. Llama 4's temperature-tuned
    layers without rotary embedding scale queries by ``cache_position``, which is the rank's
    place, not the token's, under cp."""
    types = getattr(config, "layer_types", None) or ()
    other = sorted({t for t in types if t not in LAYER_KINDS})
    if getattr(config, "attn_temperature_tuning", False) and 0 in (getattr(config, "no_rope_layers", None) or ()):
        other.append("temperature-tuned no-rope attention")
    return other
