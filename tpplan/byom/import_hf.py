"""``tpplan import-hf``: a HuggingFace ``base_model_tp_plan`` as a tpplan plan.

``transformers`` ships, per architecture, a tensor-parallel plan for the *base* model's
linear layers (``layers.*.self_attn.q_proj: colwise`` ...). A training plan needs more:
full module paths (``model.layers.*...`` in the causal-LM wrapper), the embedding and the
head, a parent ``prepare_input`` so sibling projections share one input (one gradient
all-reduce instead of one each), loss parallelism, FSDP units, and optionally sequence
parallelism. The linear styles come from ``transformers``, the rest from ``tpplan suggest``'s
dataflow analysis; where the two disagree ``transformers`` wins, with a note in the plan."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..models import build_model
from ..models.hf import causal_lm_class, causal_lm_for, hf_config, require_transformers
from ..plan.errors import PlanError, PlanErrors, nearest
from ..plan.specs import ModelSpec
from ..plan.yamlio import not_a_file
from .ep_rules import ep_patterns, route_experts
from .head_rules import take_hf_head_params
from .hf_merge import exact_hf_rules, merge_hf_rules
from .tp_fit import fit_to_tp
from .suggest import suggest_plan

__all__ = ["ImportedPlan", "import_hf"]

@dataclass
class ImportedPlan:
    model: dict[str, Any]
    suggestion: Any  # Suggestion, with its rules replaced by transformers' own
    source: str


def _config_file(target: str) -> Path | None:
    """The config.json ``target`` names (a file or its folder), None when it names no path;
    a path that cannot be read as JSON is an error naming it."""
    path = Path(target)
    if not path.exists():
        if target.endswith(".json") or os.sep in target:
            _fail(f"cannot read '{target}': No such file or directory")
        return None
    file = path / "config.json" if path.is_dir() else path
    if path.is_dir() and not file.exists():
        _fail(f"'{target}' is a folder without a config.json")
    kind = not_a_file(file.stat().st_mode)
    if kind:
        _fail(f"cannot read '{file}': it is {kind}, not a JSON config")
    try:
        data = json.loads(file.read_text())
    except OSError as e:
        _fail(f"cannot read '{file}': {e.strerror}")
    except ValueError as e:
        _fail(f"'{file}' is not a JSON config: {e}")
    if not isinstance(data, dict) or "model_type" not in data:
        _fail(f"'{file}' has no 'model_type'; a transformers config.json names its architecture")
    return file


def _fail(message: str):
    raise PlanErrors([PlanError(message)])


def _causal_lm(config: Any, what: str) -> type:
    cls = causal_lm_for(type(config))
    if cls is None:
        _fail(f"transformers has no causal language model for {what} ({type(config).__name__}); "
              "tpplan trains next-token prediction (a *ForCausalLM class)")
    return cls


def _resolve(target: str) -> tuple[ModelSpec, dict[str, Any], Any]:
    """ARCH_OR_CONFIG -> (ModelSpec, the plan's model section, config object)."""
    transformers = require_transformers()
    file = _config_file(target)
    if file is not None:
        spec = ModelSpec(hf_config=str(target), base_dir=".")
        config = hf_config(spec)
        _causal_lm(config, f"'{file}'")
        return spec, {"hf_config": str(target)}, config
    if getattr(transformers, target, None) is not None:
        try:
            cls = causal_lm_class(target)
        except ValueError as e:
            _fail(str(e))
        return ModelSpec(hf=target), {"hf": target, "config": {}}, cls.config_class()
    try:
        config = transformers.AutoConfig.for_model(target)
    except ValueError:
        names = [n for n in dir(transformers) if n.endswith("ForCausalLM")]
        _fail(f"'{target}' is not a config.json, a transformers model class or a model type"
              f"{nearest(target, names)}")
    cls = _causal_lm(config, f"model type '{target}'")
    return ModelSpec(hf=cls.__name__), {"hf": cls.__name__, "config": {}}, config


def import_hf(target: str, sequence_parallel: bool = False, tp: int | None = None
              ) -> ImportedPlan:
    """Read ``base_model_tp_plan`` for ``target`` and build the full plan's parts (for
    ``tp``: KV heads fewer than tp get ``kv_colwise``)."""
    spec, model_section, config = _resolve(target)
    tp_plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    if not tp_plan:
        raise PlanErrors([PlanError(f"transformers ships no base_model_tp_plan for "
                                    f"{type(config).__name__}; try 'tpplan suggest' on it")])
    transformers = require_transformers()
    cls = getattr(transformers, model_section.get("hf", ""), None) or causal_lm_for(type(config))
    prefix = cls.base_model_prefix
    if model_section.get("hf"):
        spec.hf_kwargs = {}
    sugg = suggest_plan(spec, "blocks" if sequence_parallel else "off")

    model = build_model(spec, "meta")
    modules = dict(model.named_modules())
    params = {n for n, _ in model.named_parameters()}
    hf_rules = {f"{prefix}.{key}": style for key, style in tp_plan.items()}
    heads = take_hf_head_params(hf_rules, modules, params, sugg.notes)  # sinks: per head
    hf_rules = exact_hf_rules(hf_rules, modules, params, sugg)
    merge_hf_rules(sugg, hf_rules, heads, modules, sequence_parallel)
    if tp:
        fit_to_tp(sugg, model, tp)
    source = f"{type(config).__name__}.base_model_tp_plan (transformers {transformers.__version__})"
    return ImportedPlan(model_section, sugg, source)




EP_DISPATCH = "ep_dispatch_experts"  # transformers' base_model_ep_plan: experts routed over ep


def with_expert_parallel(imported: ImportedPlan, target: str) -> None:
    """transformers' ``base_model_ep_plan`` in place: each module it routes over ep
    (``ep_dispatch_experts``) gets tpplan's ``expert_parallel`` instead of its tp rule (the
    per-parameter ``grouped_gemm`` entries are what ``expert_parallel`` does to the module's
    parameters). Without an ep plan (Llama 4), the experts modules ``expert_parallel`` can
    spread, with a note; PlanErrors when there are none."""
    spec, _, config = _resolve(target)
    if spec.hf:
        spec.hf_kwargs = {}
    model = build_model(spec, "meta")
    paths = [n for n, _ in model.named_modules()]
    ep_plan = dict(getattr(config, "base_model_ep_plan", None) or {})
    prefix = causal_lm_for(type(config)).base_model_prefix
    patterns = [f"{prefix}.{k}" for k, v in ep_plan.items() if v == EP_DISPATCH]
    source = f"transformers' ep plan: {EP_DISPATCH}"
    if not patterns:  # Llama 4: experts tpplan can spread, without transformers' ep plan
        patterns = ep_patterns(model)
        source = "experts held as [num_experts, ...] parameters (no transformers ep plan)"
        imported.suggestion.notes.append(f"transformers ships no base_model_ep_plan for "
                                         f"{type(config).__name__}; {source}")
    if not patterns:
        raise PlanErrors([PlanError(f"{type(config).__name__}: transformers ships no "
                                    "base_model_ep_plan and the model has no experts module "
                                    "expert_parallel can spread (docs/moe.md)")])
    route_experts(imported.suggestion, paths, patterns, source)
