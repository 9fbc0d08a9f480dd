"""Checks of a plan that need to know what a module does with its weights: whole heads
per rank, per-head norms beside colwise projections, tied weights kept one weight. Run by
:func:`tpplan.parallel.resolve.resolve`, errors located at the rule."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from ...plan.errors import ErrorList
from ...plan.specs import Rule
from .head_params import head_params_of
from .tied import tied_groups

__all__ = ["check_composite", "check_latent", "check_heads", "check_norms_beside_colwise", "check_tied",
           "check_whole_model", "composite_children"]


def shard_dims(style: str, module: nn.Module) -> dict[str, int] | None:
    from ..resolve import shard_dims as dims

    return dims(style, module)


def _gathered(rule: Rule) -> bool:
    out = rule.style.options.get("output_layouts")
    return getattr(out, "kind", None) == "replicate"


def composite_children(module: nn.Module) -> list[str]:
    """Children of a linear or embedding that hold parameters of their own (Inkling's
    embedding with its ``embed_norm`` inside)."""
    return [n for n, m in module.named_children() if any(True for _ in m.parameters())]


def check_composite(rule: Rule, path: str, module: nn.Module, errs: ErrorList) -> None:
    """PyTorch's colwise/rowwise styles shard every parameter under the module as its own
    (``register_parameter('embed_norm.weight')`` fails): refuse, located at the rule."""
    inner = composite_children(module)
    if inner:
        errs.add(f"module '{path}' ({type(module).__name__}) holds modules with parameters of "
                 f"their own ({', '.join(inner)}): PyTorch's {rule.style.name} style shards a "
                 "bare nn.Linear or nn.Embedding only; leave it replicated (no rule)", rule.loc)


def check_latent(rule: Rule, path: str, module: nn.Module, parent: nn.Module | None,
                 errs: ErrorList) -> None:
    """``mla_kv_a_proj`` needs a linear layer and the rotary key's width."""
    from .latent import rope_dim_of

    rope = rule.style.options.get("rope_dim") or rope_dim_of(parent)
    if not isinstance(module, nn.Linear) or not rope or rope >= module.out_features:
        errs.add(f"rule '{rule.pattern}' (mla_kv_a_proj) on '{path}' ({type(module).__name__}) "
                 "needs a linear layer whose output ends with the rotary key: give rope_dim, "
                 "or an attention with 'qk_rope_head_dim'", rule.loc)


def _check_mla_kv(plan, model: nn.Module, errs: ErrorList) -> None:
    """Latent attention whose config sets fewer KV heads than heads, which transformers
    cannot run (:func:`tpplan.parallel.tp.latent.latent_kv_heads_mismatch`): an error at the
    plan's ``model`` section."""
    from .latent import latent_kv_heads_mismatch

    why = latent_kv_heads_mismatch(model)
    if why:
        errs.add(why, getattr(plan.model, "loc", None))


def check_heads(rule: Rule, path: str, module: nn.Module, parent: nn.Module | None, tp: int,
                 errs: ErrorList) -> None:
    """A colwise projection of whole heads (its parent stores ``head_dim``) must give each
    rank whole heads: KV heads fewer than tp (2 KV heads at tp 4) would split a head, and the
    attention's reshape fails mid-forward (transformers#48307)."""
    head_dim = getattr(parent, "head_dim", None)
    if rule.style.name != "colwise" or not isinstance(module, nn.Linear) or _gathered(rule) \
            or not isinstance(head_dim, int) or head_dim <= 0 or module.out_features % head_dim:
        return
    heads = module.out_features // head_dim
    if heads % tp:
        kv = " (KV heads fewer than tp)" if heads < tp else ""
        if tp % heads:
            fix = (f"tp={tp} is not a multiple of {heads} either, so replicating KV heads "
                   f"(kv_colwise) does not fit; use a tp that divides {heads} or a multiple of it")
        elif hasattr(parent, "num_key_value_groups"):
            fix = "give it 'kv_colwise' (each rank computes the KV head its query heads use)"
        else:  # kv_colwise tells the attention its local groups through that attribute
            fix = (f"use a tp that divides {heads} ('kv_colwise' needs an attention that reads "
                   "its query heads per KV head from 'num_key_value_groups', as transformers' "
                   f"does, and {type(parent).__name__} does not)")
        errs.add(f"module '{path}' projects {heads} heads of head_dim {head_dim}{kv} and "
                 f"tp={tp} does not divide {heads}: each rank would hold part of a head; {fix}",
                 rule.loc)


def check_norms_beside_colwise(res: Any, modules: dict) -> None:
    """A norm inside a module whose projections are colwise (Qwen3's ``self_attn.q_norm``)
    sees only this rank's heads. Without a rule its weight's gradient is a partial sum (wrong
    numbers, no error): it needs ``{style: sequence_parallel, sequence_dim: 2,
    use_local_output: true}`` if it normalizes each head, or the projections gathered."""
    seen: set[str] = set()
    # Only inside a sub-layer: a parent holding a rowwise linear too (attention, MLP),
    # not the model's root, whose final norm feeds the head its whole input.
    with_rowwise = {p.rpartition(".")[0] for p, r in res.rule_of.items()
                    if r.style.name == "rowwise" and isinstance(modules[p], nn.Linear)}
    for path, rule in res.rule_of.items():
        if rule.style.name != "colwise" or _gathered(rule) or \
                not isinstance(modules[path], nn.Linear):
            continue
        parent = path.rpartition(".")[0]
        if not parent or parent not in with_rowwise:
            continue
        split = head_params_of(res.rule_of.get(parent))
        own = [n for n, p in modules[parent].named_parameters(recurse=False)
               if p.numel() > 1 and n not in split]
        if own and parent not in seen:
            seen.add(parent)
            names, mine = ", ".join(own), res.rule_of.get(parent)
            fix = f"add 'head_params: [{names}]' to rule '{mine.pattern}'" if mine else \
                f"give '{parent}' {{style: local_params, head_params: [{names}]}}"
            res.errors.add(f"module '{parent}' ({type(modules[parent]).__name__}) uses parameters "
                           f"of its own ({names}) beside '{path}', which rule '{rule.pattern}' "
                           "shards colwise, so it sees this rank's heads only: if they hold one "
                           f"entry per head, {fix} (each rank keeps its heads' entries); else "
                           "leave this module replicated", rule.loc)
        for name, child in modules[parent].named_children():
            norm = f"{parent}.{name}"
            weight = getattr(child, "weight", None)
            width = weight.numel() if isinstance(weight, nn.Parameter) else 0
            # A norm over the block's width reads the residual stream (OPT keeps those
            # beside its fc1); one over heads or a projection's width acts on its output.
            # A norm as wide as some projection's input there feeds it (DeepSeek's
            # q_a_layernorm before q_b_proj), one as wide as an unsharded projection's output
            # reads it (AXK2's q_a_layernorm after q_a_proj): it sees a whole tensor.
            feeds = any(isinstance(m, nn.Linear) and (m.in_features == width or (
                m.out_features == width and f"{parent}.{n}" not in res.rule_of))
                for n, m in modules[parent].named_children())
            acts_on_output = width and not feeds and modules[path].out_features % width == 0
            if "norm" in type(child).__name__.lower() and acts_on_output \
                    and norm not in res.rule_of and norm not in seen:
                seen.add(norm)
                res.errors.add(
                    f"module '{norm}' ({type(child).__name__}) sits beside '{path}', which rule "
                    f"'{rule.pattern}' shards colwise: it sees this rank's heads only and has no "
                    "rule, so its weight's gradient would be a partial sum; give it "
                    "'{style: sequence_parallel, sequence_dim: 2, use_local_output: true}' if it "
                    "normalizes each head, or gather the projection (output_layouts: replicate)",
                    rule.loc)


def check_whole_model(plan, res: Any, model: nn.Module, modules: dict) -> None:
    """The checks that look at the whole model (not at one stage): tied weights, latent
    attention's KV heads."""
    check_tied(res, model, modules)
    _check_mla_kv(plan, model, res.errors)


def check_tied(res: Any, model: nn.Module, modules: dict) -> None:
    """A weight shared by several modules (tied embeddings) stays one weight: every owner must
    shard it along the same dimension (a ``rowwise`` embedding and a ``colwise`` head both
    split dimension 0), and one FSDP unit must hold all its owners."""
    owner_unit = {p: unit for unit, paths in res.units for p in paths}
    for group in tied_groups(model):
        split = {}
        for path, attr in group:
            rule = res.rule_of.get(path)
            dims = shard_dims(rule.style.name, modules[path]) if rule else None
            split[path] = (dims or {}).get(attr)
        names = " and ".join(f"'{p}.{a}'" for p, a in group)
        if len(set(split.values())) > 1:
            how = ", ".join(f"'{p}' {'dimension %d' % d if d is not None else 'whole'}"
                            for p, d in split.items())
            loc = next((res.rule_of[p].loc for p, _ in group if p in res.rule_of), None)
            res.errors.add(f"{names} are one tied weight, sharded differently ({how}): shard "
                           "both on dimension 0 (embedding rowwise, head colwise) or neither", loc)
        units = {id(owner_unit[p]): owner_unit[p] for p, _ in group if p in owner_unit}
        if len(units) > 1 or (units and len([p for p, _ in group if p in owner_unit]) < len(group)):
            unit = next(iter(units.values()))
            res.errors.add(f"{names} are one tied weight in two FSDP units: put their modules "
                           f"in one unit (a list: [{', '.join(p for p, _ in group)}])", unit.loc)
