"""Per-head parameters a module uses itself (attention sinks, Beam's ``gate_bias``), as
``suggest`` finds them and as ``import-hf`` reads transformers' rules for them.

transformers says it in two entries: the parameter sharded as if it were a module
(``layers.*.self_attn.sinks: colwise``) and its owner run with local tensors
(``layers.*.self_attn: local_params``). tpplan's rule is one option on the owner:
``head_params: [sinks]`` on its ``prepare_input`` rule, or ``{style: local_params,
head_params: [sinks]}`` where it has none (tpplan.parallel.tp.head_params).
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from ..plan.patterns import compile_pattern

__all__ = ["per_head_params", "with_head_params", "hf_head_params", "merge_local_params",
           "take_hf_head_params", "attach_head_params"]

Rule = tuple[str, Any, str]


def _head_counts(holder: nn.Module) -> set[int]:
    """Integers the module (or its config) holds under a head-count name."""
    out = set()
    for source in (vars(holder), getattr(getattr(holder, "config", None), "__dict__", {})):
        for name, value in source.items():
            if isinstance(value, int) and not isinstance(value, bool) and value > 1 and \
                    "head" in name and not any(w in name for w in ("dim", "size", "group")):
                out.add(value)
    return out


def per_head_params(holder: nn.Module, colwise: list[nn.Module]) -> list[str]:
    """The holder's own 1-D parameters with one entry per head of its colwise projections:
    as many entries as a head count it stores, which divides a projection's width."""
    counts = _head_counts(holder)
    return [name for name, p in holder.named_parameters(recurse=False)
            if p.dim() == 1 and p.shape[0] in counts and any(
                isinstance(m, nn.Linear) and m.out_features % p.shape[0] == 0 for m in colwise)]


def with_head_params(rules: list[Rule], owner: str, names: list[str]) -> list[Rule]:
    """``rules`` with ``head_params: names`` on ``owner``'s rule, or a ``local_params`` rule
    for it where it has none."""
    why = (f"its own per-head {', '.join(names)}: each rank keeps its heads' entries (split "
           "with the heads of the colwise projections below)")
    out, done = [], False
    for pattern, style, comment in rules:
        if pattern == owner and not done:
            style = {"style": style} if isinstance(style, str) else dict(style)
            style["head_params"] = list(names)
            comment, done = f"{comment}; {why}", True
        out.append((pattern, style, comment))
    if not done:
        out.append((owner, {"style": "local_params", "head_params": list(names)}, why))
    return out


def hf_head_params(hf_rules: dict[str, str], modules: dict[str, nn.Module], params: set[str]
                   ) -> tuple[dict[str, list[str]], list[str]]:
    """transformers' ``X.p: colwise`` beside ``X: local_params``, with ``p`` a parameter of
    ``X`` itself: ``{X: [p, ...]}`` and the rule keys that said it (consumed)."""
    owners = [p for p, s in hf_rules.items() if s == "local_params"]
    found: dict[str, list[str]] = {}
    used = []
    for owner in owners:
        rx = compile_pattern(owner)
        hits = [m for m in modules if rx.fullmatch(m)]
        for key, style in hf_rules.items():
            head, _, name = key.rpartition(".")
            if head != owner or style != "colwise" or not hits or \
                    f"{hits[0]}.{name}" not in params or f"{hits[0]}.{name}" in modules:
                continue
            found.setdefault(owner, []).append(name)
            used.append(key)
        if owner in found:
            used.append(owner)
    return found, used


def merge_local_params(rules: list[Rule]) -> list[Rule]:
    """Where two rules name one module (the whole-sequence ``prepare_input_output`` of an
    attention under sequence parallelism, then its group's own rule), the first one, which
    stands, gets the ``head_params`` the other says; a ``local_params`` duplicate goes."""
    heads = {}
    for pattern, style, _ in rules:
        if isinstance(style, dict) and style.get("head_params"):
            heads.setdefault(pattern, style["head_params"])
    out, seen = [], set()
    for pattern, style, comment in rules:
        if pattern in seen:
            if not (isinstance(style, dict) and style.get("style") == "local_params"):
                out.append((pattern, style, comment))
            continue
        seen.add(pattern)
        has = isinstance(style, dict) and style.get("head_params")
        out += [(pattern, style, comment)] if has or pattern not in heads else \
            with_head_params([(pattern, style, comment)], pattern, heads[pattern])
    return out


def take_hf_head_params(hf_rules: dict[str, str], modules: dict[str, nn.Module], params: set[str],
                        notes: list[str]) -> dict[str, list[str]]:
    """transformers' per-head parameter entries out of ``hf_rules`` (they are not module
    rules), as ``{owner pattern: [names]}`` for :func:`attach_head_params`."""
    found, used = hf_head_params(hf_rules, modules, params)
    for owner, names in found.items():
        notes.append(f"transformers' '{owner}: local_params' with "
                     f"{', '.join(repr(f'{owner}.{n}: colwise') for n in names)}: tpplan's "
                     f"head_params [{', '.join(names)}] on '{owner}' (each rank keeps its "
                     "heads' entries)")
    for key in used:
        del hf_rules[key]
    return found


def attach_head_params(rules: list[Rule], found: dict[str, list[str]], hits) -> list[Rule]:
    """Each owner's ``head_params`` onto the rule that covers the same modules (its
    ``prepare_input``), or a ``local_params`` rule of its own."""
    sharded = {m for p, st, _ in rules if (st if isinstance(st, str) else st["style"])
               in ("colwise", "packed_colwise", "kv_colwise") for m in hits(p)}
    kept = []
    for p, st, c in rules:  # the dataflow's head_params where transformers leaves the
        if isinstance(st, dict) and st.get("head_params") and not any(  # projections whole
                m.rpartition(".")[0] in set(hits(p)) for m in sharded):
            if st["style"] == "local_params":
                continue
            st = {k: v for k, v in st.items() if k != "head_params"}
        kept.append((p, st, c))
    rules = kept
    for owner, names in found.items():
        mine = set(hits(owner))
        if not any(m.rpartition(".")[0] in mine for m in sharded):
            continue  # its projections stay whole here (blocks run replicated): so do they
        target = next((p for p, _, _ in rules if mine & set(hits(p))), owner)
        rules = with_head_params(rules, target, names)
    return rules
