"""Expert parallelism in a generated plan (``import-hf --ep``, ``suggest --ep``): which
experts modules get ``expert_parallel`` and the note that proposes it (docs/moe.md)."""

from __future__ import annotations

import re

import torch.nn as nn

from ..parallel.experts.style import expert_count, experts_for_ep
from ..plan.patterns import compile_pattern

__all__ = ["ep_patterns", "ep_proposal", "route_experts", "with_ep"]

PROPOSAL = "expert parallelism fits them"


def ep_patterns(model: nn.Module) -> list[str]:
    """One pattern per kind of experts module ``expert_parallel`` can spread (the block index
    as ``*``: ``model.layers.*.mlp.experts``, which matches the MoE blocks only)."""
    return sorted({re.sub(r"\.\d+\.", ".*.", p, count=1) for p in experts_for_ep(model)})


def ep_proposal(model: nn.Module) -> str | None:
    """The note proposing expert parallelism for a model with experts, with the reason."""
    found = experts_for_ep(model)
    if not found:
        return None
    counts = sorted({expert_count(m) for p, m in model.named_modules() if p in found})
    held = "as [num_experts, ...] parameters" if not all(
        isinstance(m, nn.ModuleList) for p, m in model.named_modules() if p in found) \
        else "in a list of expert modules"
    return (f"{', '.join(ep_patterns(model))} hold {'/'.join(map(str, counts))} routed experts "
            f"{held}: {PROPOSAL} (--ep N, N dividing "
            "the experts and the data-parallel ranks): each of N ranks keeps 1/N of the experts "
            "whole and tokens go to them by all-to-all, where tp alone gives every rank 1/tp "
            "of every expert (experts_colwise_rowwise) and all-reduces their output, or leaves "
            "them replicated (docs/moe.md)")


def route_experts(sugg, paths: list[str], patterns: list[str], source: str) -> None:
    """``expert_parallel`` on the modules ``patterns`` match, in place of any rule on the same
    modules or inside them (a list's experts stay whole) whatever its pattern (blocks unlike
    the first get rules narrowed to ``layers.0...``): one module takes one rule. Under
    sequence parallelism the MoE blocks then run on the sequence shard
    (:func:`on_sequence_shard`)."""
    routed = {p for rx in map(compile_pattern, patterns) for p in paths if rx.fullmatch(p)}
    covered = routed | {p for p in paths if any(p.startswith(r + ".") for r in routed)}
    comment = (f"{source}; each ep rank keeps 1/ep of the routed experts, tokens dispatched "
               "and combined by all-to-all")
    sugg.notes = [n for n in sugg.notes if PROPOSAL not in n]  # done, not proposed
    kept = [r for r in sugg.rules if r[0] in patterns or not any(
        compile_pattern(r[0]).fullmatch(p) for p in covered)]
    have = {r[0] for r in kept}
    sugg.rules = [(r[0], "expert_parallel", comment) if r[0] in patterns else r
                  for r in kept] + [(p, "expert_parallel", comment) for p in patterns
                                    if p not in have]
    on_sequence_shard(sugg, paths, routed)


SEQUENCE_COMMENT = ("the MoE block on this rank's sequence shard: router and shared experts "
                    "replicated on tp (gradients summed over tp), routed experts by all-to-all "
                    "over ep, which borrows tp's ranks (docs/moe.md)")


def _gathers_sequence(style) -> bool:
    """A rule that hands its module the whole sequence from the sequence shard (the
    suggestion's rule on an MoE block under sequence parallelism)."""
    return isinstance(style, dict) and style.get("style", "").startswith("prepare_input") and \
        str(style.get("input_layouts")) == "shard(1)" and \
        str(style.get("desired_input_layouts")) == "replicate"


def on_sequence_shard(sugg, paths: list[str], routed: set[str]) -> None:
    """Where every routed experts module's block gets the whole sequence from the sequence
    shard, the block runs on the shard instead (``sequence_local``; ep then borrows tp's
    ranks) and the rules inside it other than the experts' go (its shared experts run
    replicated on the shard). Blocks that run without sequence parallelism (unlike the
    first), or only some of them under it, keep the gathered form: ep beside tp."""
    blocks = {p.rpartition(".")[0] for p in routed}
    hits = {r[0]: {p for p in paths if compile_pattern(r[0]).fullmatch(p)} for r in sugg.rules}
    whole = [r for r in sugg.rules if hits[r[0]] and hits[r[0]] <= blocks and _gathers_sequence(r[1])]
    if not blocks or set().union(*(hits[r[0]] for r in whole)) != blocks:
        return
    inside = {r[0] for r in sugg.rules if hits[r[0]] and not hits[r[0]] & routed and all(
        any(p.startswith(b + ".") for b in blocks) for p in hits[r[0]])}
    sugg.rules = [(r[0], "sequence_local", SEQUENCE_COMMENT) if r in whole else r
                  for r in sugg.rules if r[0] not in inside]
    gathered = tuple(f"'{r[0]}' runs on the whole sequence" for r in whole)
    sugg.notes = [n for n in sugg.notes if not n.startswith(gathered)]


def with_ep(sugg, spec) -> None:
    """``suggest --ep``: ``expert_parallel`` on every experts module the style can spread;
    PlanErrors when the model has none."""
    from ..models import build_model
    from ..plan.errors import PlanError, PlanErrors

    model = build_model(spec, "meta")
    patterns = ep_patterns(model)
    if not patterns:
        raise PlanErrors([PlanError("--ep: the model has no experts module expert_parallel can "
                                    "spread (a module with 'num_experts' and its own "
                                    "[num_experts, ...] parameters; docs/moe.md)")])
    lists = all(isinstance(model.get_submodule(p), nn.ModuleList) for p in experts_for_ep(model))
    route_experts(sugg, [n for n, _ in model.named_modules()], patterns,
                  "a list of expert modules" if lists else
                  "experts held as [num_experts, ...] parameters")
