"""HuggingFace ``transformers`` causal LMs as a model source (``pip install 'tpplan[hf]'``).

Built from a configuration only, never from downloaded weights, so it works offline and on
the meta device. The model's forward returns the logits tensor (a forward hook unpacks
``CausalLMOutput.logits``), so the trainer, the dry run and verify treat it like any other
model: tokens in, logits out.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from .._torch.transformers import can_set_experts_implementation, causal_lm_mapping, from_config
from ..plan.errors import ErrorList, PlanError, PlanErrors, nearest
from ..plan.specs import ModelSpec
from ..plan.yamlio import not_a_file
from .hf_experts import register_shapes_only
from .hf_stages import mark_stageable
from .moe_loss import keep_aux_loss

__all__ = ["TOKENIZER_FILES", "build_hf", "causal_lm_class", "causal_lm_for", "hf_config", "hf_config_path",
           "require_transformers"]

# The files of an HF folder that make up its tokenizer (those present): what the token cache
# hashes for the tokenizer's identity, and what an HF export copies.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json",
                   "merges.txt", "added_tokens.json")
EXTRA_HINT = "HuggingFace models need the 'hf' extra: pip install 'tpplan[hf]'"
# HF config fields every decoder needs at least 1 of; other sizes may be 0, never negative.
POSITIVE_FIELDS = {"hidden_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "intermediate_size", "vocab_size", "head_dim",
                   "max_position_embeddings", "n_embd", "n_layer", "n_head", "n_positions"}
SIZE_FIELD = re.compile(r"^num_|^n_|_size$|_dim$|_heads$|_layers$")


def require_transformers(loc=None):
    try:
        import transformers
    except ImportError:
        raise PlanErrors([PlanError(EXTRA_HINT, loc)]) from None
    return transformers


def _init_std_for(model: nn.Module, std: float):
    """The ``init_std(name)`` protocol of tpplan's initializer for a HF model: weights
    normal(0, initializer_range), norm weights ones (None), biases zeros (std 0)."""
    norms = {f"{path}.weight" for path, m in model.named_modules()
             if "norm" in type(m).__name__.lower()}

    def init_std(name: str) -> float | None:
        if name.endswith("bias"):
            return 0.0
        return None if name in norms else std

    return init_std


def _logits_only(module: nn.Module, args: Any, output: Any) -> Any:
    keep_aux_loss(module, output)  # a MoE's load-balancing loss, for the trainer (moe_loss)
    return output.logits if hasattr(output, "logits") else output


def _meta_mask(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """On the meta device (the dry run's traces), hand the model a ready 4-D mask:
    transformers' mask code otherwise reads tensor values (its packed-sequence check calls
    ``.item()``), which meta tensors do not have. Only shapes matter there; real runs are
    left to transformers' own causal mask."""
    ids = args[0] if args else kwargs.get("input_ids")
    if isinstance(ids, torch.Tensor) and ids.device.type == "meta" and \
            kwargs.get("attention_mask") is None and ids.dim() == 2:
        b, s = ids.shape
        kwargs = {**kwargs, "attention_mask": torch.ones(b, 1, s, s, dtype=torch.bool,
                                                         device="meta")}
        if getattr(getattr(module, "config", None), "output_router_logits", False):
            # a MoE's aux loss (a few scalars) would read this mask as a per-token one
            kwargs["output_router_logits"] = False
    return args, kwargs


def hf_config_path(spec: ModelSpec) -> Path:
    """The config.json a plan's ``hf_config`` names: a relative path is looked for next to
    the plan first, a folder means its ``config.json``."""
    path = spec.path(spec.hf_config)
    return path / "config.json" if path.is_dir() else path


def hf_config(spec: ModelSpec):
    """The ``transformers`` config object the plan describes (``hf_config`` or ``hf`` + ``config``);
    a relative ``hf_config`` is looked for next to the plan first."""
    transformers = require_transformers(spec.loc)
    if spec.hf_config:
        loc = spec.locs.get("hf_config", spec.loc)
        path = hf_config_path(spec)
        try:
            kind = not_a_file(path.stat().st_mode)
            if kind:
                raise PlanErrors([PlanError(f"model.hf_config: cannot read '{path}': it is {kind}, "
                                            "not a JSON config", loc)])
            data = json.loads(path.read_text())
        except OSError as e:
            raise PlanErrors([PlanError(f"model.hf_config: cannot read '{path}': {e.strerror}",
                                        loc)]) from None
        except ValueError as e:
            raise PlanErrors([PlanError(f"model.hf_config: '{path}' is not JSON: {e}", loc)]) from None
        if not isinstance(data, dict):
            raise PlanErrors([PlanError(f"model.hf_config: '{path}' holds a JSON "
                                        f"{type(data).__name__}, not a config (an object)", loc)])
        model_type = data.pop("model_type", None)
        data.update(spec.hf_kwargs)  # the plan's model.config overrides the file
        try:
            return transformers.AutoConfig.for_model(model_type, **data)
        except ValueError as e:
            raise PlanErrors([PlanError(f"model.hf_config: {e}", loc)]) from None
        except Exception as e:  # noqa: BLE001 - a field of the wrong type, a failed check
            raise PlanErrors([_config_error(e, spec, f"'{path}'", loc)]) from None
    cls = _model_class(spec)
    try:
        return cls.config_class(**dict(spec.hf_kwargs))
    except Exception as e:  # noqa: BLE001 - as above
        raise PlanErrors([_config_error(e, spec, "model.config",
                                        spec.locs.get("config", spec.loc))]) from None


def _config_error(e: Exception, spec: ModelSpec, source: str, loc) -> PlanError:
    """transformers' (huggingface_hub's strict dataclass) refusal of a config field as one
    located line: at the plan's ``model.config.<field>`` when the plan sets it, else at the
    config file's line, naming the field and what it expected."""
    cause = e.__cause__ if e.__cause__ is not None else e
    field = re.search(r"field '(\w+)'", str(e))
    reason = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    if field:
        name = field.group(1)
        reason = re.sub(rf"^Field '{name}' ", "", reason)
        where = f"model.config.{name}" if name in spec.hf_kwargs else f"{source}: field '{name}'"
        return PlanError(f"{where}: {reason}", spec.locs.get(f"config.{name}", loc))
    return PlanError(f"{source}: transformers refuses the config: {reason}", loc)


def _model_class(spec: ModelSpec):
    try:
        return causal_lm_class(spec.hf)
    except ValueError as e:
        raise PlanErrors([PlanError(f"model.hf: {e}", spec.locs.get("hf", spec.loc))]) from None


def causal_lm_for(config_class: type | None) -> type | None:
    """transformers' causal-LM class for a configuration class, if it has one."""
    transformers = require_transformers()
    try:
        return causal_lm_mapping(transformers, config_class)
    except (KeyError, TypeError):
        return None


def causal_lm_class(name: str) -> type:
    """The transformers causal-LM class called ``name``. ``ValueError`` says why another
    name is not one (an abstract base, a configuration, a function, a model without a
    language-model head) and which class to use instead."""
    transformers = require_transformers()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    known = sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()))
    obj = getattr(transformers, name, None)
    config_class = obj if isinstance(obj, type) and issubclass(
        obj, transformers.PretrainedConfig) else getattr(obj, "config_class", None)
    lm = causal_lm_for(config_class) if isinstance(config_class, type) else None
    concrete = (isinstance(obj, type) and issubclass(obj, transformers.PreTrainedModel)
                and isinstance(config_class, type) and obj.forward is not nn.Module.forward)
    if concrete and (obj is lm or name in known or name.endswith(("ForCausalLM", "LMHeadModel"))):
        return obj
    hint = (f"try '{lm.__name__}'" if lm is not None else nearest(name, known, 0.85).strip(" ()")
            or "name a causal language model class such as 'LlamaForCausalLM'")
    if obj is None:
        return _fail(f"transformers has no model class '{name}'", hint)
    if not isinstance(obj, type):
        return _fail(f"'{name}' is a {type(obj).__name__} in transformers, not a model class", hint)
    if config_class is obj:
        return _fail(f"'{name}' is a configuration class, not a model class", hint)
    if not issubclass(obj, transformers.PreTrainedModel):
        return _fail(f"'{name}' is not a model class", hint)
    if not concrete:
        return _fail(f"'{name}' is not a concrete model class (an abstract base without a "
                     "configuration or a forward)", hint)
    return _fail(f"'{name}' is not a causal language model (tpplan trains next-token "
                 "prediction: a *ForCausalLM class)", hint)


def _fail(what: str, hint: str):
    raise ValueError(f"{what}; {hint}")


def _check_sizes(spec: ModelSpec) -> None:
    """The plan's sizes among the HF config fields: positive where every architecture needs
    them, never negative where the name says size; located, before transformers divides by
    them (a zero head count is a ZeroDivisionError deep inside its config)."""
    errs = ErrorList()
    for key, v in spec.hf_kwargs.items():
        if not isinstance(v, int) or isinstance(v, bool):
            continue
        low = 1 if key in POSITIVE_FIELDS else 0 if SIZE_FIELD.search(key) else None
        if low is not None and v < low:
            errs.add(f"'model.config.{key}' must be at least {low}, got {v}",
                     spec.locs.get(f"config.{key}", spec.loc))
    errs.raise_if_any()


def _from_config(transformers, cls, config, kwargs: dict) -> nn.Module:
    if cls is not None:
        return from_config(cls, config, **kwargs)
    return transformers.AutoModelForCausalLM.from_config(config, **kwargs)


def build_hf(spec: ModelSpec, config=None) -> nn.Module:
    """Construct the model on the current default device (``meta`` in the dry run), from
    ``config`` when given (a shrunk copy, say), else from the plan's."""
    transformers = require_transformers(spec.loc)
    _check_sizes(spec)
    config = config or hf_config(spec)
    config.use_cache = False  # training: no KV cache
    cls = _model_class(spec) if spec.hf else causal_lm_for(type(config))
    # fp32 parameters whatever dtype the config (or a bf16 checkpoint) names: the trainer's
    # master weights; lower precision is the plan's mixed-precision setting.
    kwargs = {"attn_implementation": "sdpa", "dtype": torch.float32}
    if torch.empty(0).device.type == "meta" and cls is not None and \
            can_set_experts_implementation(cls):
        # A real run's grouped_mm, on shapes alone (hf_experts.py: what the dry run's traces
        # save is what the real run saves); batched_mm where this transformers lacks it.
        kwargs["experts_implementation"] = register_shapes_only() or "batched_mm"
    try:
        model = _from_config(transformers, cls if spec.hf else None, config, kwargs)
    except ValueError as e:
        if "does not support an attention implementation" not in str(e):
            raise
        # Architectures without an SDPA path (Gemma 2's soft-capping, say) run eager attention.
        model = _from_config(transformers, cls if spec.hf else None, config,
                             {**kwargs, "attn_implementation": "eager"})
    model.register_forward_hook(_logits_only)
    model.register_forward_pre_hook(_meta_mask, with_kwargs=True)
    model.init_std = _init_std_for(model, getattr(config, "initializer_range", 0.02))
    mark_stageable(model)  # pipeline stages: how to cut it, or why it cannot be cut
    return model
