"""What tpplan reads off a model without being told: its repeated blocks, its norms, its
vocabulary, and a tiny configuration of the same architecture (for ``verify`` and for
tracing a HuggingFace model's dataflow on the CPU)."""

from __future__ import annotations

import json
from typing import Any

import torch.nn as nn

from ..plan.errors import PlanError, PlanErrors
from ..plan.specs import ModelSpec

__all__ = ["find_blocks", "first_block", "is_norm", "vocab_size", "token_ids", "small_hf_fields",
           "shrink_overrides"]


def find_blocks(model: nn.Module, called: set[str] | None = None) -> str | None:
    """Path of the repeated blocks: of the ``ModuleList``/``ModuleDict`` of two or more
    children that all share one type (``layers`` in a Llama, ``model.layers`` in HF), the one
    holding the most parameters (then the longest); with ``called`` (the paths a traced forward
    ran), only one whose first block ran (Phi-4-multimodal's vision encoder layers hold more
    than its decoder layers, but a text forward does not run them)."""
    best, score = None, (0, 1)
    for path, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.ModuleDict)) or len(module) < 2 or \
                len({type(m) for m in module.children()}) != 1:
            continue
        first = next(iter(module.named_children()))[0]
        if called is not None and (f"{path}.{first}" if path else first) not in called:
            continue
        mine = (sum(p.numel() for p in module.parameters()), len(module))
        if mine > score:
            best, score = path, mine
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


def token_ids(model: nn.Module, spec: ModelSpec) -> int:
    """:func:`vocab_size` for a caller that feeds the model token ids (``verify``): a model
    with none is refused at the plan's ``model`` line, as it cannot tell which ids it takes."""
    if (vocab := vocab_size(model)) is None:
        raise PlanErrors([PlanError(
            f"{f'model.factory {spec.factory!r}' if spec.factory else 'the model'} builds a "
            f"{type(model).__name__} with no token embedding (nn.Embedding) and no config."
            "vocab_size: verify feeds a model a batch of token ids and cannot tell which ids it "
            "takes", spec.locs.get("factory", spec.loc))])
    return vocab


def _keep_residue(n: int | None, tp: int, base: int) -> int:
    """``base`` (a multiple of tp) plus ``n``'s remainder modulo tp: a size tp divides stays
    divisible, one it does not stays indivisible (verify must see what the real size sees)."""
    return base + (n % tp if isinstance(n, int) else 0)


def _heads(config: Any, tp: int) -> tuple[int, int]:
    """Query and KV heads of the tiny model, with the real model's relations to tp: where
    tp divides both, ``max(tp, 2)`` KV heads (twice as many query heads when grouped); where
    it does not (KV heads fewer than tp, say), the real counts themselves (width 8 per head
    keeps them small)."""
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    if isinstance(heads, int) and isinstance(kv, int) and (heads % tp or kv % tp):
        return heads, kv
    grouped = kv != heads
    small_kv = max(tp, 2)
    return (2 * small_kv if grouped else small_kv), small_kv


# Mixture-of-experts and latent-attention sizes of the tiny model (the fields a family has).
SMALL_MOE = {"num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4,
             "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
             "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8,
             "qk_nope_head_dim": 8, "v_head_dim": 8, "index_n_heads": 4, "index_head_dim": 16,
             "zero_expert_num": 2}  # LongCat's identity experts


# A multimodal model's vision and audio encoders, shrunk (Phi-4-multimodal's causal LM holds
# them; a text forward does not run them, but verify builds them).
SMALL_ENCODER = {"hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2,
                 "num_blocks": 2, "num_attention_heads": 2, "ext_pw_out_channel": 64,
                 "depthwise_separable_out_channel": 64, "nemo_conv_channels": 64,
                 "image_size": 28}


def small_hf_fields(config: Any, tp: int, layers: int = 2) -> dict[str, Any]:
    """HF config fields of a tiny model of the same architecture with every relation of the
    real one to ``tp`` kept: head and KV-head counts (:func:`_heads`), width 8 per head,
    hidden widths in multiples of 64·tp and the vocabulary's remainder modulo tp. Only the
    fields this architecture has."""
    if hasattr(config, "allow_global_per_layer_attribute_access"):  # Gemma 4: per-layer
        config.allow_global_per_layer_attribute_access = True  # fields read as the global one
    heads, kv = _heads(config, tp)
    small = {"num_hidden_layers": layers, "num_attention_heads": heads,
             "num_key_value_heads": kv, "hidden_size": heads * 8, "head_dim": 8,
             "intermediate_size": _keep_residue(getattr(config, "intermediate_size", None),
                                                tp, 64 * tp),
             "ffn_dim": 64 * tp, "word_embed_proj_dim": heads * 8,
             "moe_intermediate_size": 16 * tp, "shared_expert_intermediate_size": 32 * tp,
             "vocab_size": _keep_residue(getattr(config, "vocab_size", None), tp, 64 * tp),
             "vocab_size_per_layer_input": 64 * tp, "hidden_size_per_layer_input": 8,
             "laurel_rank": 8, "num_kv_shared_layers": 0, **SMALL_MOE}
    out = {k: v for k, v in small.items() if isinstance(getattr(config, k, None), int)}
    blocks, hidden = getattr(config, "num_layers", None), getattr(config, "num_hidden_layers", None)
    if isinstance(blocks, int) and isinstance(hidden, int) and blocks and hidden > blocks:
        out["num_hidden_layers"] = layers * (hidden // blocks)  # LongCat: 2 per block, so
        # ``layers`` blocks still (the repeated blocks must repeat)
    if hasattr(config, "num_experts_per_tok") and "n_routed_experts" in out:
        out["num_experts_per_tok"] = SMALL_MOE["num_experts_per_tok"]  # DeepSeek-V2: None
    for key in ("num_key_value_heads", "head_dim"):  # None: "as many as heads", "derived"
        if key not in out and hasattr(config, key):  # (Ministral's attention never derives it)
            out[key] = small[key]
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):  # ids past the tiny vocab
        value = getattr(config, key, None)
        if isinstance(value, int) and value >= small["vocab_size"]:
            out[key] = None if key == "pad_token_id" else 0  # (CWM requires bos and eos)
    expand, mamba_heads = getattr(config, "mamba_expand", None), getattr(config, "mamba_n_heads", 0)
    if isinstance(expand, int) and isinstance(mamba_heads, int) and mamba_heads > 0:
        out.update(mamba_n_heads=2 * tp, mamba_d_state=16, mamba_n_groups=1,  # Granite 4
                   mamba_d_head=expand * small["hidden_size"] // (2 * tp))
    text = getattr(config, "text_config", None)  # Llama 4's decoder inside the composite
    if hasattr(text, "to_dict") and text is not config:
        out["text_config"] = {**text.to_dict(), **small_hf_fields(text, tp, layers)}
    for key in ("vision_config", "audio_config"):  # encoders a text forward never runs
        sub = getattr(config, key, None)
        if hasattr(sub, "to_dict"):
            data = sub.to_dict()
            out[key] = {**data, **{k: v for k, v in SMALL_ENCODER.items()
                                   if isinstance(data.get(k), int)}}
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, list) and len(layer_types) > layers:
        out["layer_types"] = list(layer_types[:layers])
    return out


def shrink_overrides(spec: ModelSpec | None, tp: int, layers: int, seq_len: int) -> list[str]:
    """``--set`` lines that shrink the plan's model to a tiny one of the same architecture,
    keeping every split over ``tp`` divisible. The built-in Llama gets ``max(tp, 2)`` KV
    heads, twice as many query heads of width 8, widths in multiples of 32·tp (the built-in
    MoE keeps its experts, top-k and shared expert, and one MoE block at least); a
    HuggingFace model :func:`small_hf_fields`; a factory model is left as its kwargs say."""
    if spec is not None and spec.is_hf:
        from .hf import hf_config

        fields = small_hf_fields(hf_config(spec), tp, layers)
        return [f"model.config.{k}={json.dumps(v)}" for k, v in fields.items()]
    if spec is None or spec.factory or spec.name not in ("llama3", "moe"):
        return []
    kv = max(tp, 2)
    heads = 2 * kv
    out = [f"model.kwargs.n_layers={layers}", f"model.kwargs.n_heads={heads}",
           f"model.kwargs.n_kv_heads={kv}", f"model.kwargs.dim={heads * 8}",
           f"model.kwargs.multiple_of={32 * tp}", "model.kwargs.ffn_dim_multiplier=null",
           f"model.kwargs.vocab_size={64 * tp}", f"model.kwargs.max_seq_len={seq_len}"]
    if spec.name == "moe":  # expert count, top-k and shared expert kept; a MoE block at least
        from .moe import CONFIGS

        cfg = {**vars(CONFIGS.get(spec.config or "debug", CONFIGS["debug"])), **spec.kwargs}
        every = cfg["moe_every"] if isinstance(cfg["moe_every"], int) else 1
        out[0] = f"model.kwargs.n_layers={max(layers, every)}"
        out += ["model.kwargs.ffn_hidden=null", f"model.kwargs.moe_hidden={32 * tp}"] + \
            ([f"model.kwargs.shared_hidden={32 * tp}"] if cfg["shared_hidden"] else [])
    return out
