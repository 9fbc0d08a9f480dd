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
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from ..models import build_model
from ..models.hf import causal_lm_class, causal_lm_for, hf_config, require_transformers
from ..plan.errors import PlanError, PlanErrors, nearest
from ..plan.patterns import compile_pattern
from ..plan.specs import ModelSpec
from ..plan.styles import ALIASES, STYLES
from ..plan.yamlio import not_a_file
from .ep_rules import ep_patterns, route_experts
from .head_rules import attach_head_params, take_hf_head_params
from .hf_rules import unshardable
from .import_rules import GRAD_ALLREDUCE, expand, grad_allreduce_rule, like_blocks, regroup
from .packing import keeps_packed
from .sp_regions import sequence_regions, writes_sequence_shard
from .tp_fit import fit_to_tp
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


def _mapped(style: str, sequence_parallel: bool) -> Any:
    """transformers' style name as a tpplan rule (aliases spelled out, so SP can add to them)."""
    name, preset = ALIASES.get(style, (style, {}))
    opts = {k: str(v) for k, v in preset.items()}
    if name == "rowwise" and sequence_parallel:
        opts["output_layouts"] = "shard(1)"
    return {"style": name, **opts} if opts else name


COVERED = {GRAD_ALLREDUCE: "per-head norm rule from the dataflow"}  # tpplan's


def _drop_per_head_under_gather(rules: list, unfed: dict[str, bool]) -> list:
    """A projection transformers gathers (colwise with replicated output) or does not shard
    (``unfed``) hands whole heads to the norms after it: they need no per-head rule there (it
    would treat the whole as a shard)."""
    gathered = {p.rpartition(".")[0] for p, st, _ in rules if isinstance(st, dict)
                and st.get("style") == "colwise" and st.get("output_layouts") == "replicate"}
    gathered |= {p for p, whole in unfed.items() if whole}
    return [(p, st, c) for p, st, c in rules
            if not (isinstance(st, dict) and "sequence_dim" in st
                    and p.rpartition(".")[0] in gathered)]


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
    suggested = [compile_pattern(p) for p, _, _ in sugg.rules]
    allreduce = set()  # transformers' replicated_with_grad_allreduce on norms tpplan makes
    for pattern, style in list(hf_rules.items()):
        why = unshardable(pattern, style, modules, params) if style in EXACT else None
        if why:
            sugg.notes.append(why)
            del hf_rules[pattern]
        elif style in COVERED and any(rx.fullmatch(m) for rx in suggested for m in modules
                                      if compile_pattern(pattern).fullmatch(m)):
            continue  # the dataflow's own rule for these modules stands
        elif style == GRAD_ALLREDUCE and grad_allreduce_rule(pattern, [
                m for p, m in modules.items() if compile_pattern(pattern).fullmatch(p)]):
            allreduce.add(pattern)  # a norm: its rule is made below, for the blocks it covers
        elif style not in EXACT:
            sugg.notes.append(f"transformers' '{style}' for '{pattern}' has no exact PyTorch "
                              "equivalent; left out")
    hf_rules = {p: s for p, s in hf_rules.items() if s in EXACT or p in allreduce}

    def hits(pattern: str) -> list[str]:
        rx = compile_pattern(pattern)
        return [m for m in modules if rx.fullmatch(m)]

    in_blocks = re.compile(rf"{re.escape(sugg.blocks or '')}\.(\*|\d+|\{{[\d,]+\}})\.")
    rules, used, unfed = [], set(), {}  # unfed: parent -> whether all its input readers stay whole
    for pattern, style, comment in sugg.rules:
        name = style if isinstance(style, str) else style["style"]
        if name not in ("colwise", "rowwise", "packed_colwise") or not in_blocks.match(pattern):
            rules.append((pattern, style, comment))
            continue
        # A suggested linear rule: replace it by transformers' style for the same modules.
        kept, idle = [], []
        for member in expand(pattern):
            found = hits(member)
            hf = next((p for p in hf_rules if found and compile_pattern(p).fullmatch(found[0])),
                      None)
            if hf is None:
                sugg.notes.append(f"transformers' plan does not shard '{member}' (the dataflow "
                                  f"suggests {name}); left replicated")
                idle.append(member)
                if isinstance(style, dict) and style.get("output_layouts") == "shard(1)":
                    rules.append((member, {"style": "prepare_output", "output_layouts":
                                           "replicate", "desired_output_layouts": "shard(1)",
                                           "use_local_output": True},
                                  "replicated, it writes the whole sequence: its shard goes back "
                                  "to the residual stream"))
                continue
            used.add(hf)
            if name == "packed_colwise" or keeps_packed(sugg.rules, member, hf_rules[hf]):
                sugg.notes.append(f"'{member}': transformers says {hf_rules[hf]}; tpplan "
                                  "shards each packed part instead "
                                  f"({name}, as the dataflow suggests)")
                rules.append((member, style, comment))
                continue
            kept.append((member, hf_rules[hf]))
            if hf_rules[hf] != name:
                sugg.notes.append(f"'{member}': transformers says {hf_rules[hf]}, the dataflow "
                                  f"suggests {name}; using transformers'")
        if name in ("colwise", "packed_colwise") and idle:
            unfed[pattern.rpartition(".")[0]] = len(idle) == len(expand(pattern))
        seq = isinstance(style, dict) and style.get("output_layouts") == "shard(1)"
        for group, hf_style in regroup(kept):  # (not in a branch run on the whole sequence)
            rules.append((group, _mapped(hf_style, seq), f"transformers: {hf_style}"))
    covered = {m for p, _, _ in rules for m in hits(p)}
    regions = sequence_regions(rules, hits)
    for pattern, style in hf_rules.items():
        if pattern in used:
            continue
        pattern = like_blocks(pattern, sugg.blocks, sugg.like_blocks, hits, covered)
        if set(hits(pattern)) & covered:  # blocks the dataflow's rules handle (some or all)
            sugg.notes.append(f"transformers' '{pattern}: {style}' is covered by the rules above "
                              "where the blocks are like the first; the others run replicated")
            continue
        if sequence_parallel and sugg.blocks and not all(
                any(m.startswith(b + ".") for b in regions[0]) for m in hits(pattern)):
            sugg.notes.append(f"transformers' '{pattern}: {style}' is in blocks that run "
                              "without sequence parallelism (they differ from the first); "
                              "left replicated")
            continue
        seq = sequence_parallel and writes_sequence_shard(hits(pattern), regions)
        rules.append(grad_allreduce_rule(pattern, [modules[m] for m in hits(pattern)])
                     if style == GRAD_ALLREDUCE else
                     (pattern, _mapped(style, seq), f"transformers: {style}"))
    sugg.rules = attach_head_params(_without_idle_prepares(
        _drop_per_head_under_gather(rules, unfed), hits, unfed), heads, hits)
    sugg.divide_by_tp = [p for p in sugg.divide_by_tp if not unfed.get(p.rpartition(".")[0])]
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


def _without_idle_prepares(rules: list, hits, unfed: dict[str, bool]) -> list:
    """A parent's prepare_input is there for the projections it shares one input among; where
    transformers shards none of them (none below) or leaves one reading the parent's input
    whole (``unfed``: DeepSeek-V2's attention shards q_b_proj and kv_b_proj, not q_a_proj,
    which a DTensor input would break), it goes (replicated in, replicated out), or under
    sequence parallelism the module gets the whole sequence as a local tensor (its last
    projection hands back the shard): never a DTensor that plain layers cannot take."""
    sharded = {m for p, st, _ in rules
               if (st if isinstance(st, str) else st["style"]) in ("colwise", "rowwise")
               for m in hits(p)}
    out = []
    for p, st, c in rules:
        if isinstance(st, dict) and st["style"] == "prepare_input" and (p in unfed or not any(
                m.startswith(h + ".") for h in hits(p) for m in sharded)):
            layouts = [v for k, v in st.items() if "layouts" in k]
            if all("shard" not in str(v) for v in layouts):
                continue
            st = {**st, "use_local_output": True}  # the whole sequence, as a local tensor
            c = "no projection below is sharded: " + c
        out.append((p, st, c))
    return out
