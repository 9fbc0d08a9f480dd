"""HuggingFace decoder-only causal LMs as pipeline stages.

transformers' ``*Model.forward`` builds the position ids, the rotary tables and the causal
mask from the input ids, then runs ``self.layers[:num_hidden_layers]`` and the final norm;
``*ForCausalLM.forward`` applies ``lm_head``. A middle stage has no input ids and only some
layers, so a stage runs :func:`stage_forward` instead: the same steps over what it owns --
the embedding on the first stage, its layers, the norm and the head on the last -- with the
positions, rotary tables and masks rebuilt from the sequence length of the hidden states it
receives (the whole sequence: HF plans gather the sequence back between blocks).

A model can be a stage when its causal LM is exactly ``<prefix>`` + ``lm_head``, its base
model exactly ``embed_tokens``, ``layers`` (a ``ModuleList``), ``norm`` and ``rotary_emb``,
its layers' attention types are full or sliding-window causal, and its family's forward is
known to be those steps and nothing more (:data:`VERIFIED`: checked by
``scripts/sweep_hf_stages.py``, a split model against the whole one). Anything else gets
the reason it cannot be split (:func:`stage_refusal`). docs/pipeline.md lists the families.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn

__all__ = ["BASE_CHILDREN", "VERIFIED", "enable_stages", "layout_refusal", "mark_stageable", "stage_forward",
           "stage_refusal"]

# The base model's children, in forward order, that the stage loop knows how to run.
BASE_CHILDREN = ("embed_tokens", "layers", "norm", "rotary_emb")
# Families whose forward is embed -> layers -> norm -> lm_head with full or sliding-window
# causal masks and nothing else between (scripts/sweep_hf_stages.py checks each one: a
# model split into stages run one after the other gives the whole model's logits).
VERIFIED = frozenset({
    "afmoe", "apertus", "arcee", "aria_text", "axk1", "cohere", "cohere2", "cohere2_moe",
    "deepseek_v2", "deepseek_v3", "ernie4_5", "ernie4_5_moe", "exaone4", "exaone_moe",
    "flex_olmo", "flint", "gemma", "gemma2", "gemma3_text", "glm", "glm4", "glm4_moe",
    "glm4_moe_lite", "granite", "granitemoe", "granitemoeshared", "helium", "hunyuan_v1_moe",
    "hy_v3", "hyperclovax", "internlm3", "iquestcoder", "jais2", "kolibri1", "laguna", "llama",
    "longcat_flash", "mellum", "mimo_v2_flash", "minicpm3", "minimax_m2", "minimax_m3_vl_text",
    "ministral", "ministral3", "mistral", "mixtral", "nemotron", "olmo", "olmo2", "olmo3",
    "olmoe", "phi3", "phimoe", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "seed_oss",
    "smollm3", "solar_open", "starcoder2", "vaultgemma", "youtu",
})
MASKS = ("full_attention", "sliding_attention")
# Families whose forward uses a sliding-window mask on every layer when the config has a
# window (their configs have no layer_types).
SLIDING_EVERYWHERE = frozenset({"mistral", "mixtral"})


def stage_refusal(model: nn.Module) -> str | None:
    """Why ``model`` (a transformers causal LM) cannot run as pipeline stages, or None."""
    why = layout_refusal(model)
    kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    if why is None and kind not in VERIFIED:
        why = (f"model type '{kind}' has the decoder layout, but its forward has not been "
               "checked against the stage wrapper's (scripts/sweep_hf_stages.py)")
    return why


def layout_refusal(model: nn.Module) -> str | None:
    """Why the stage wrapper cannot hold ``model``'s modules, or None (its family's forward
    may still do more than the wrapper: :data:`VERIFIED`)."""
    prefix = getattr(model, "base_model_prefix", "model")
    base = getattr(model, prefix, None)
    roots = [n for n, _ in model.named_children()]
    if base is None or roots != [prefix, "lm_head"]:
        return (f"{type(model).__name__}'s children are {roots}, not the decoder layout "
                f"['{prefix}', 'lm_head'] a stage wrapper can hold")
    children = [n for n, _ in base.named_children()]
    if sorted(children) != sorted(BASE_CHILDREN):
        other = [n for n in children if n not in BASE_CHILDREN]
        missing = [n for n in BASE_CHILDREN if n not in children]
        return (f"{type(base).__name__} holds {children}: the stage wrapper runs exactly "
                f"{list(BASE_CHILDREN)}" + (f" (extra: {other})" if other else "")
                + (f" (missing: {missing})" if missing else ""))
    if not isinstance(base.layers, nn.ModuleList):
        return f"{prefix}.layers is a {type(base.layers).__name__}, not a ModuleList"
    config = base.config
    odd = sorted({k for k in _layer_types(config, len(base.layers)) if k not in MASKS})
    if odd:
        return (f"its layers use attention types {odd} (config.layer_types); the stage wrapper "
                f"builds {' and '.join(MASKS)} masks only")
    if getattr(config, "use_bidirectional_attention", False):
        return "use_bidirectional_attention is set; the stage wrapper builds causal masks only"
    return None


def _layer_types(config, n: int) -> list[str]:
    """Each layer's attention type, by its whole-model index: ``config.layer_types``, else
    sliding-window everywhere where the config has a window and the family applies it to
    every layer (Mistral, Mixtral), else full causal attention."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    if getattr(config, "sliding_window", None) is not None and \
            getattr(config, "model_type", "") in SLIDING_EVERYWHERE:
        return ["sliding_attention"] * n
    return ["full_attention"] * n


def mark_stageable(model: nn.Module) -> None:
    """Tell tpplan's pipeline split how to cut ``model``: ``stage_blocks`` (the layers' path)
    and ``stage_forward``, or ``stage_refusal`` (why not)."""
    why = stage_refusal(model)
    if why is not None:
        model.stage_refusal = why
        return
    enable_stages(model)


def enable_stages(model: nn.Module) -> None:
    """Mark ``model`` as cut by the stage wrapper (whatever :func:`stage_refusal` says)."""
    model.__dict__.pop("stage_refusal", None)
    model.stage_blocks = f"{model.base_model_prefix}.layers"
    model.stage_shared = (f"{model.base_model_prefix}.rotary_emb",)  # tables on every stage
    model.stage_forward = stage_forward


def stage_forward(self: nn.Module, x: torch.Tensor, attention_mask=None,
                  position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """One stage of a causal LM: token ids in on the first stage (``embed_tokens`` owned),
    the previous stage's hidden states elsewhere; the logits out of the last stage
    (``lm_head`` owned), the hidden states out of the others. ``position_ids`` (bs, s), given
    to every stage alike: packed documents' restarting positions, or the global positions of
    a context-parallel rank's tokens; None: ``0..s-1``."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    base = getattr(self, self.base_model_prefix)
    h = x if base.embed_tokens is None else base.embed_tokens(x)
    if base.embed_tokens is not None and hasattr(base, "embedding_multiplier"):
        h = h * base.embedding_multiplier  # Granite
    b, s = h.shape[:2]
    if attention_mask is None and h.device.type == "meta":  # as build_hf's meta pre-hook
        attention_mask = torch.ones(b, 1, s, s, dtype=torch.bool, device="meta")
    if position_ids is None:
        position_ids = torch.arange(s, device=h.device).unsqueeze(0)
    types = _layer_types(base.config, base.config.num_hidden_layers)
    per_type = "layer_type" in inspect.signature(base.rotary_emb.forward).parameters
    masks: dict[str, object] = {}
    tables: dict[str, object] = {}
    for key, layer in base.layers.named_children():  # whole-model indices on every stage
        kind = types[int(key)]
        if kind not in masks:
            make = create_sliding_window_causal_mask if kind == "sliding_attention" \
                else create_causal_mask
            masks[kind] = make(config=base.config, inputs_embeds=h, attention_mask=attention_mask,
                               past_key_values=None, position_ids=position_ids)
            if per_type:  # Gemma 3: other rotary parameters for sliding layers
                tables[kind] = base.rotary_emb(h, position_ids, kind)
            else:
                tables[kind] = tables.get("all") or base.rotary_emb(h, position_ids)
                tables["all"] = tables[kind]
        h = layer(h, attention_mask=masks[kind], position_embeddings=tables[kind],
                  position_ids=position_ids)
    if base.norm is not None:
        h = base.norm(h)
    if self.lm_head is None:
        return h
    logits = self.lm_head(h)
    return _finish_logits(self.config, logits)


def _finish_logits(config, logits: torch.Tensor) -> torch.Tensor:
    """What some families' causal-LM forward does to the logits after ``lm_head``."""
    scale = getattr(config, "logit_scale", None)  # Cohere
    if scale:
        logits = logits * scale
    scaling = getattr(config, "logits_scaling", None)  # Granite
    if scaling:
        logits = logits / scaling
    cap = getattr(config, "final_logit_softcapping", None)  # Gemma 2 and 3
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits
