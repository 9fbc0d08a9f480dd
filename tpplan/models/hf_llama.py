"""tpplan's built-in Llama against HuggingFace's ``LlamaForCausalLM``: names, config, RoPE.

The two hold the same tensors under different names (:data:`NAMES`). Their attention differs
in one more way: the built-in rotates *consecutive* pairs of each head's dimensions (Meta's
layout, ``rope_layout: interleaved``), HF rotates dimension ``i`` with ``i + head_dim/2``
(``rope_layout: half``). The two are the same model up to a permutation of ``wq``/``wk`` rows
inside each head (:func:`half_to_interleaved`), so a built-in Llama that starts from HF
weights is built with ``rope_layout: half`` and loads every tensor unchanged -- each rank
reads only its own slices -- and one trained with the interleaved layout has its q/k rows
permuted when exported to HF.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from .llama import LlamaConfig

__all__ = ["NAMES", "config_from_hf", "config_mismatches", "from_hf_name", "half_to_interleaved",
           "hf_config_dict", "interleaved_to_half", "is_rotary", "to_hf_name"]

# built-in name pattern -> HF name pattern ({i}: the block index)
NAMES: dict[str, str] = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "layers.{i}.attention.wq.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "layers.{i}.attention.wk.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "layers.{i}.attention.wv.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "layers.{i}.attention.wo.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.feed_forward.w1.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "layers.{i}.feed_forward.w2.weight": "model.layers.{i}.mlp.down_proj.weight",
    "layers.{i}.feed_forward.w3.weight": "model.layers.{i}.mlp.up_proj.weight",
    "layers.{i}.attention_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _compile(table: dict[str, str]) -> list[tuple[re.Pattern, str]]:
    return [(re.compile("^" + re.escape(src).replace(r"\{i\}", r"(?P<i>\d+)") + "$"), dst)
            for src, dst in table.items()]


_TO_HF = _compile(NAMES)
_FROM_HF = _compile({v: k for k, v in NAMES.items()})


def _translate(name: str, table: list[tuple[re.Pattern, str]]) -> str | None:
    for pattern, dst in table:
        m = pattern.match(name)
        if m:
            return dst.format(**m.groupdict())
    return None


def to_hf_name(name: str) -> str | None:
    """The HF name of a built-in Llama parameter (None: no HF counterpart)."""
    return _translate(name, _TO_HF)


def from_hf_name(name: str) -> str | None:
    """The built-in Llama name of an HF Llama tensor (None: the built-in has no such tensor)."""
    return _translate(name, _FROM_HF)


def is_rotary(name: str) -> bool:
    """Whether RoPE acts on this weight's output rows (q and k projections)."""
    return name.endswith(("attention.wq.weight", "attention.wk.weight"))


def interleaved_to_half(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of a q/k projection for ``rope_layout: interleaved`` reordered for ``half``: in
    each head, the even dimensions first, then the odd ones (HF's conversion script does the
    inverse)."""
    rows = w.shape[0]
    return w.reshape(rows // head_dim, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2) \
        .reshape(w.shape)


def half_to_interleaved(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Inverse of :func:`interleaved_to_half`."""
    rows = w.shape[0]
    return w.reshape(rows // head_dim, 2, head_dim // 2, *w.shape[1:]).transpose(1, 2) \
        .reshape(w.shape)


def _rope_of(hf: dict[str, Any]) -> tuple[float, dict | None, str | None]:
    """(theta, Llama 3.1 scaling or None, an unsupported rope type or None) of an HF config:
    transformers 5 keeps them in ``rope_parameters``, older files in ``rope_theta`` and
    ``rope_scaling``."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None, None
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        return theta, {k: params[k] for k in keys}, None
    return theta, None, kind


def config_from_hf(hf: dict[str, Any]) -> tuple[LlamaConfig | None, list[str]]:
    """The built-in Llama configuration (``rope_layout: half``) of an HF Llama ``config.json``,
    or None and why it cannot be one."""
    why = []
    if hf.get("model_type") not in ("llama", None):
        why.append(f"model_type is '{hf.get('model_type')}', not 'llama'")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            why.append(f"{flag} is true (the built-in Llama has no biases)")
    if hf.get("hidden_act", "silu") != "silu":
        why.append(f"hidden_act is '{hf['hidden_act']}', not silu")
    theta, scaling, unsupported = _rope_of(hf)
    if unsupported:
        why.append(f"rope type '{unsupported}' (the built-in Llama knows default and llama3)")
    try:
        heads = hf["num_attention_heads"]
        cfg = LlamaConfig(dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=heads,
                          n_kv_heads=hf.get("num_key_value_heads") or heads,
                          vocab_size=hf["vocab_size"], norm_eps=hf.get("rms_norm_eps", 1e-6),
                          rope_theta=theta, max_seq_len=hf.get("max_position_embeddings", 2048),
                          rope_layout="half", rope_scaling=scaling,
                          ffn_hidden=hf["intermediate_size"])
    except KeyError as e:
        return None, why + [f"it has no '{e.args[0]}'"]
    head_dim = hf.get("head_dim") or cfg.dim // cfg.n_heads
    if head_dim * cfg.n_heads != cfg.dim:
        why.append(f"head_dim {head_dim} × {cfg.n_heads} heads ≠ hidden_size {cfg.dim}")
    return (None if why else cfg), why


def config_mismatches(ours: LlamaConfig, theirs: LlamaConfig) -> list[str]:
    """The fields where two configurations build different shapes or numerics, as
    ``field ours vs theirs``."""
    out = []
    for field in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "hidden_dim",
                  "norm_eps", "rope_theta"):
        a, b = getattr(ours, field), getattr(theirs, field)
        if a != b:
            out.append(f"{field} {a} vs {b}")
    return out


def hf_config_dict(cfg: LlamaConfig, dtype: str = "float32") -> dict[str, Any]:
    """An HF ``LlamaForCausalLM`` ``config.json`` for the built-in configuration."""
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        rope = {"rope_type": "llama3", "rope_theta": cfg.rope_theta, **cfg.rope_scaling}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim, "intermediate_size": cfg.hidden_dim,
        "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len, "rope_parameters": rope,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "dtype": dtype,
    }
