"""``tpplan import-hf``: a HuggingFace ``base_model_tp_plan`` as a tpplan plan.

``transformers`` ships, per architecture, a tensor-parallel plan for the *base* model's
linear layers (``layers.*.self_attn.q_proj: colwise`` ...). A training plan needs more:
full module paths (``model.layers.*...`` in the causal-LM wrapper), the embedding and the
head, a parent ``prepare_input`` so sibling projections share one input (one gradient
all-reduce instead of one each), loss parallelism, FSDP units, and optionally sequence
parallelism. The linear styles come from ``transformers``; the rest from the same dataflow
analysis as ``tpplan suggest``, and where the two disagree ``transformers`` wins and the
disagreement is written into the plan as a note.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..models.hf import causal_lm_class, causal_lm_for, hf_config, require_transformers
from ..plan.errors import PlanError, PlanErrors, nearest
from ..plan.patterns import compile_pattern, generalize
from ..plan.specs import ModelSpec
from ..plan.styles import ALIASES, STYLES
from .suggest import suggest_plan

__all__ = ["ImportedPlan", "import_hf"]

EXACT = set(STYLES) | set(ALIASES)  # HF names that mean exactly a PyTorch style


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
    if not file.is_file():
        _fail(f"'{target}' is a folder without a config.json")
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


def _mapped(style: str, sequence_parallel: bool) -> Any:
    if style == "rowwise" and sequence_parallel:
        return {"style": "rowwise", "output_layouts": "shard(1)"}
    return style


def import_hf(target: str, sequence_parallel: bool = False) -> ImportedPlan:
    """Read ``base_model_tp_plan`` for ``target`` and build the full plan's parts."""
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

    hf_rules = {f"{prefix}.{key}": style for key, style in tp_plan.items()}
    for pattern, style in hf_rules.items():
        if style not in EXACT:
            sugg.notes.append(f"transformers' '{style}' for '{pattern}' has no exact PyTorch "
                              "equivalent; left out")
    hf_rules = {p: s for p, s in hf_rules.items() if s in EXACT}

    rules, used = [], set()
    for pattern, style, comment in sugg.rules:
        name = style if isinstance(style, str) else style["style"]
        if name not in ("colwise", "rowwise") or not pattern.startswith(f"{sugg.blocks}.*."):
            rules.append((pattern, style, comment))
            continue
        # A suggested linear rule: replace it by transformers' style for the same modules.
        members = _expand(pattern)
        for member in members:
            hf = next((p for p in hf_rules if compile_pattern(p).fullmatch(member)), None)
            if hf is None:
                sugg.notes.append(f"transformers' plan does not shard '{member}' (the dataflow "
                                  f"suggests {name}); left replicated")
                continue
            used.add(hf)
            if hf_rules[hf] != name:
                sugg.notes.append(f"'{member}': transformers says {hf_rules[hf]}, the dataflow "
                                  f"suggests {name}; using transformers'")
        kept = [m for m in members if any(compile_pattern(p).fullmatch(m) for p in hf_rules)]
        for group in _regroup(kept, hf_rules):
            rules.append((group[0], _mapped(group[1], sequence_parallel),
                          f"transformers: {group[1]}"))
    for pattern, style in hf_rules.items():
        if pattern not in used:
            rules.append((pattern, _mapped(style, sequence_parallel), f"transformers: {style}"))
    sugg.rules = rules
    source = f"{type(config).__name__}.base_model_tp_plan (transformers {transformers.__version__})"
    return ImportedPlan(model_section, sugg, source)


def _expand(pattern: str) -> list[str]:
    """``a.*.{x,y}`` -> ``[a.*.x, a.*.y]``."""
    if "{" not in pattern:
        return [pattern]
    head, _, rest = pattern.partition("{")
    alts, _, tail = rest.partition("}")
    return [f"{head}{a}{tail}" for a in alts.split(",")]


def _regroup(members: list[str], hf_rules: dict[str, str]) -> list[tuple[str, str]]:
    """Members with the same HF style and parent back into one brace pattern."""
    groups: dict[tuple[str, str], list[str]] = {}
    for m in members:
        style = next(s for p, s in hf_rules.items() if compile_pattern(p).fullmatch(m))
        parent, _, name = generalize(m).rpartition(".")
        groups.setdefault((parent, style), []).append(name)
    return [(f"{parent}.{{{','.join(names)}}}" if len(names) > 1 else f"{parent}.{names[0]}",
             style) for (parent, style), names in groups.items()]
