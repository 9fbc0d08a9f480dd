"""What tpplan reads off a model without being told: its repeated blocks, its norms, its
vocabulary, and a tiny configuration of the same architecture (for ``verify`` and for
tracing a HuggingFace model's dataflow on the CPU)."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from ..plan.specs import ModelSpec

__all__ = ["find_blocks", "first_block", "is_norm", "vocab_size", "small_hf_fields",
           "shrink_overrides"]


def find_blocks(model: nn.Module) -> str | None:
    """Path of the repeated blocks: the longest ``ModuleList``/``ModuleDict`` of two or more
    children that all share one type (``layers`` in a Llama, ``model.layers`` in HF)."""
    best, size = None, 1
    for path, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and len(module) > size:
            if len({type(m) for m in module.children()}) == 1:
                best, size = path, len(module)
    return best


def first_block(model: nn.Module, blocks: str) -> str:
    """The path of the first block in the container at ``blocks`` (``layers.0``)."""
    name = next(iter(model.get_submodule(blocks).named_children()))[0]
    return f"{blocks}.{name}" if blocks else name


def is_norm(module: nn.Module) -> bool:
    """A normalization layer (LayerNorm, RMSNorm, HF's LlamaRMSNorm, ...), by its class name."""
    return "norm" in type(module).__name__.lower() and not list(module.children())


def vocab_size(model: nn.Module) -> int | None:
    """The model's vocabulary: ``config.vocab_size``, else the first embedding's rows."""
    cfg = getattr(model, "config", None)
    if cfg is not None and isinstance(getattr(cfg, "vocab_size", None), int):
        return cfg.vocab_size
    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return emb.num_embeddings if emb is not None else None


def small_hf_fields(config: Any, tp: int, layers: int = 2) -> dict[str, int]:
    """HF config fields of a tiny model of the same architecture, every split over ``tp``
    divisible: ``max(tp, 2)`` KV heads (as many query heads when the model has no grouped
    attention, twice as many when it has), width 8 per head, widths in multiples of 64·tp.
    Only the fields this architecture has."""
    kv = max(tp, 2)
    grouped = getattr(config, "num_key_value_heads", None) not in (
        None, getattr(config, "num_attention_heads", None))
    heads = 2 * kv if grouped else kv
    small = {"num_hidden_layers": layers, "num_attention_heads": heads,
             "num_key_value_heads": kv if grouped else heads, "hidden_size": heads * 8,
             "head_dim": 8, "intermediate_size": 64 * tp, "ffn_dim": 64 * tp,
             "word_embed_proj_dim": heads * 8, "vocab_size": 64 * tp}
    return {k: v for k, v in small.items() if hasattr(config, k)}


def shrink_overrides(spec: ModelSpec | None, tp: int, layers: int, seq_len: int) -> list[str]:
    """``--set`` lines that shrink the plan's model to a tiny one of the same architecture,
    keeping every split over ``tp`` divisible. The built-in Llama gets ``max(tp, 2)`` KV
    heads, twice as many query heads of width 8, widths in multiples of 32·tp; a
    HuggingFace model :func:`small_hf_fields`; a factory model is left as its kwargs say."""
    if spec is not None and spec.is_hf:
        from .hf import hf_config

        fields = small_hf_fields(hf_config(spec), tp, layers)
        return [f"model.config.{k}={v}" for k, v in fields.items()]
    if spec is None or spec.factory or spec.name != "llama3":
        return []
    kv = max(tp, 2)
    heads = 2 * kv
    return [f"model.kwargs.n_layers={layers}", f"model.kwargs.n_heads={heads}",
            f"model.kwargs.n_kv_heads={kv}", f"model.kwargs.dim={heads * 8}",
            f"model.kwargs.multiple_of={32 * tp}", "model.kwargs.ffn_dim_multiplier=null",
            f"model.kwargs.vocab_size={64 * tp}", f"model.kwargs.max_seq_len={seq_len}"]
