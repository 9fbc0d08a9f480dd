"""Generated plans fitted to their tp (``import-hf`` and ``suggest`` at ``--tp``):

- KV heads fewer than tp: the colwise rule of a key/value projection whose head count tp is
  a multiple of becomes ``kv_colwise`` (each rank computes the KV head its query heads use;
  :mod:`tpplan.parallel.tp.kv_heads`);
- a vocabulary tp does not divide (GPT-2's 50,257): the embedding's and the head's rules get
  ``uneven: true`` (the first ranks hold ``ceil(V/tp)`` rows, the last fewer; the weight keeps
  its real shape in checkpoints and exports, and no logit past the vocabulary exists).
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from ..plan.patterns import compile_pattern

__all__ = ["fit_to_tp", "replicate_kv_heads", "uneven_vocabulary"]


def _members(pattern: str) -> list[str]:
    """``a.*.{x,y}`` -> ``[a.*.x, a.*.y]`` (the last alternatives only)."""
    if not pattern.endswith("}"):
        return [pattern]
    head, _, alts = pattern[:-1].rpartition("{")
    return [f"{head}{a}" for a in alts.split(",")]


def _kv_heads(pattern: str, modules: dict[str, nn.Module]) -> int | None:
    """The head count of the projections ``pattern`` matches, when its attention stores
    ``head_dim``; None for anything else."""
    rx = compile_pattern(pattern)
    path = next((p for p in modules if rx.fullmatch(p)), None)
    module = modules.get(path) if path else None
    head_dim = getattr(modules.get(path.rpartition(".")[0]) if path else None, "head_dim", None)
    if not isinstance(module, nn.Linear) or not isinstance(head_dim, int) or head_dim <= 0 \
            or module.out_features % head_dim:
        return None
    return module.out_features // head_dim


def replicate_kv_heads(s: Any, model: nn.Module, tp: int) -> Any:
    """Rewrite ``s.rules`` (a Suggestion's) for ``tp``: a colwise member projecting fewer
    heads than tp, tp a multiple of them, becomes ``kv_colwise``; the plan's notes say what
    that costs. Other rules are left as they are (resolve refuses what fits neither way)."""
    modules = dict(model.named_modules())
    out = []
    for pattern, style, comment in s.rules:
        opts = {"style": style} if isinstance(style, str) else dict(style)
        if opts["style"] != "colwise" or str(opts.get("output_layouts")) == "replicate":
            out.append((pattern, style, comment))
            continue
        kv, kept = [], []
        for member in _members(pattern):
            heads = _kv_heads(member, modules)
            (kv if heads and heads < tp and tp % heads == 0 else kept).append((member, heads))
        if not kv:
            out.append((pattern, style, comment))
            continue
        parent, _, _ = kv[0][0].rpartition(".")
        for group in (kept, kv):
            if not group:
                continue
            names = [m.rpartition(".")[2] for m, _ in group]
            joined = f"{parent}.{{{','.join(names)}}}" if len(names) > 1 else group[0][0]
            if group is kept:
                out.append((joined, style, comment))
                continue
            kv_opts = {k: v for k, v in opts.items() if k == "input_layouts"}
            heads = group[0][1]
            out.append((joined, {"style": "kv_colwise", **kv_opts} if kv_opts else "kv_colwise",
                        f"{heads} KV heads at tp={tp}: each rank computes the KV head its query "
                        f"heads use ({tp // heads} ranks share one), gradients summed over tp"))
            s.notes.append(f"'{joined}': {heads} KV heads, fewer than tp={tp}; their weights are "
                           f"replicated on every tp rank (memory not divided by tp) and their "
                           "gradients all-reduced over tp (kv_colwise)")
    s.rules = out
    return s


def uneven_vocabulary(s: Any, model: nn.Module, tp: int) -> Any:
    """``uneven: true`` on the rules sharding a vocabulary tp does not divide: a rowwise
    embedding, and a colwise linear with as many outputs (the head)."""
    modules = dict(model.named_modules())
    vocabs = {m.num_embeddings for m in modules.values() if isinstance(m, nn.Embedding)}
    out = []
    for pattern, style, comment in s.rules:
        opts = {"style": style} if isinstance(style, str) else dict(style)
        rx = compile_pattern(pattern)
        module = next((m for p, m in modules.items() if rx.fullmatch(p)), None)
        rows = module.num_embeddings if isinstance(module, nn.Embedding) and \
            opts["style"] == "rowwise" else module.out_features if isinstance(module, nn.Linear) \
            and opts["style"] == "colwise" and module.out_features in vocabs else None
        if rows is not None and rows % tp and rows >= tp:
            opts["uneven"] = True
            big = -(-rows // tp)
            comment = (f"{comment}; {rows} rows, which tp={tp} does not divide: {big} on the "
                       f"first ranks, fewer on the last (uneven)")
            if not any("uneven" in n for n in s.notes):
                s.notes.append(f"the vocabulary ({rows}) is not divisible by tp={tp}: embedding "
                               "and head are split unevenly ('uneven: true'); the weights keep "
                               "their real shape in checkpoints and exports")
            style = opts
        out.append((pattern, style, comment))
    s.rules = out
    return s


def fit_to_tp(s: Any, model: nn.Module, tp: int) -> Any:
    """Both of the above."""
    return uneven_vocabulary(replicate_kv_heads(s, model, tp), model, tp)
