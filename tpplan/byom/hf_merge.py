"""transformers' ``base_model_tp_plan`` merged into the dataflow's suggestion (``tpplan import-hf``).

transformers' linear styles replace the ones the dataflow suggests for the same modules (its
own where the two disagree, with a note); a module it does not shard stays replicated; its
rules for modules no suggested rule covers are added; what neither needs (a parent's
prepare_input with no sharded projection below, per-head rules under a gathered projection)
goes.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from ..plan.patterns import compile_pattern
from ..plan.styles import ALIASES, STYLES
from .head_rules import attach_head_params
from .hf_rules import unshardable
from .import_rules import GRAD_ALLREDUCE, expand, grad_allreduce_rule, like_blocks, regroup
from .packing import keeps_packed
from .sp_regions import sequence_regions, writes_sequence_shard

__all__ = ["EXACT", "exact_hf_rules", "merge_hf_rules"]

EXACT = set(STYLES) | set(ALIASES)  # HF names that mean exactly a PyTorch style
COVERED = {GRAD_ALLREDUCE: "per-head norm rule from the dataflow"}  # tpplan's


def _mapped(style: str, sequence_parallel: bool) -> Any:
    """transformers' style name as a tpplan rule (aliases spelled out, so SP can add to them)."""
    name, preset = ALIASES.get(style, (style, {}))
    opts = {k: str(v) for k, v in preset.items()}
    if name == "rowwise" and sequence_parallel:
        opts["output_layouts"] = "shard(1)"
    return {"style": name, **opts} if opts else name


def exact_hf_rules(hf_rules: dict[str, str], modules: dict, params: set[str], sugg: Any) -> dict[str, str]:
    """transformers' rules tpplan takes: styles that mean exactly a PyTorch style on modules
    they can shard, and the per-parameter gradient all-reduce on norms it makes its own rule
    of; a note in ``sugg`` for each left out."""
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
    return hf_rules


def _linear_rules(sugg: Any, hf_rules: dict[str, str], hits: Callable[[str], list[str]]
                  ) -> tuple[list, set[str], dict[str, bool]]:
    """The suggested rules, each linear rule in the blocks replaced by transformers' style for
    the same modules. Returns them, transformers' patterns used, and ``unfed``: parent ->
    whether all its input readers stay whole."""
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
    return rules, used, unfed


def _add_remaining(rules: list, hf_rules: dict[str, str], used: set[str], sugg: Any,
                   hits: Callable[[str], list[str]], modules: dict, sequence_parallel: bool) -> None:
    """transformers' rules no suggested linear rule took, added to ``rules`` where no rule
    covers their modules already and, under sequence parallelism, where their blocks run it."""
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


def merge_hf_rules(sugg: Any, hf_rules: dict[str, str], heads: Any, modules: dict,
                   sequence_parallel: bool) -> None:
    """``sugg.rules`` with transformers' ``hf_rules`` (:func:`exact_hf_rules`) merged in, the
    per-head parameters ``heads`` attached; its ``divide_by_tp`` less the unfed parents'."""

    def hits(pattern: str) -> list[str]:
        rx = compile_pattern(pattern)
        return [m for m in modules if rx.fullmatch(m)]

    rules, used, unfed = _linear_rules(sugg, hf_rules, hits)
    _add_remaining(rules, hf_rules, used, sugg, hits, modules, sequence_parallel)
    sugg.rules = attach_head_params(_without_idle_prepares(
        _drop_per_head_under_gather(rules, unfed), hits, unfed), heads, hits)
    sugg.divide_by_tp = [p for p in sugg.divide_by_tp if not unfed.get(p.rpartition(".")[0])]


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
