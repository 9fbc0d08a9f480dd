"""Pieces of ``tpplan import-hf`` that turn one of transformers' rules into a tpplan rule
for the model at hand: which blocks it covers, and the styles with no PyTorch class.

- Blocks that differ from the first (DeepSeek's, GLM-4-MoE-Lite's and AXK2's dense first
  layers, then MoE layers) run replicated under the dataflow's rules (``layers.0.*``). A
  transformers rule the dataflow left undecided (``layers.*.self_attn.q_b_proj``) beside one
  it replaced (``layers.0.self_attn.o_proj``) must cover the same blocks, or later blocks
  would shard ``q_b_proj`` beside a whole ``o_proj``.
- ``replicated_with_grad_allreduce`` (a norm beside sharded heads whose weight's gradient
  each rank has for its own heads only, dots3's ``k_rope_only_layernorm`` on the shared
  rotary key) becomes tpplan's ``sequence_parallel`` on dimension 0: the local input is read
  as this rank's part along the batch (a norm treats every row alike), the weight is a
  replicated DTensor, so its gradient is summed over tp, and the output a local tensor again.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.nn as nn

from ..models.introspect import is_norm

__all__ = ["expand", "regroup", "like_blocks", "grad_allreduce_rule", "GRAD_ALLREDUCE"]

GRAD_ALLREDUCE = "replicated_with_grad_allreduce"


def expand(pattern: str) -> list[str]:
    """``a.*.{x,y}`` -> ``[a.*.x, a.*.y]`` (the last alternatives only)."""
    head, _, alts = pattern[:-1].rpartition("{")
    return [f"{head}{a}" for a in alts.split(",")] if pattern.endswith("}") else [pattern]


def regroup(members: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Members with the same HF style and parent back into one brace pattern."""
    groups: dict[tuple[str, str], list[str]] = {}
    for m, style in members:
        parent, _, name = m.rpartition(".")
        groups.setdefault((parent, style), []).append(name)
    return [(f"{parent}.{{{','.join(names)}}}" if len(names) > 1 else f"{parent}.{names[0]}",
             style) for (parent, style), names in groups.items()]


def like_blocks(pattern: str, blocks: str | None, like: str,
                hits: Callable[[str], list[str]], covered: set[str]) -> str:
    """``pattern`` restricted to the blocks like the first (``like``: ``0``, ``{0,2}``) where
    the dataflow's rules are restricted so and hold a rule beside it there (``o_proj`` beside
    ``q_b_proj``): they run together. Where they hold none (an attention the dataflow left
    alone) or the module is only in the other blocks (the MoE layers' experts), transformers'
    rules stand together on every block: the pattern is kept."""
    star = f"{blocks}.*."
    if not blocks or like == "*" or not pattern.startswith(star):
        return pattern
    narrowed = f"{blocks}.{like}.{pattern[len(star):]}"
    parents = {m.rpartition(".")[0] for m in hits(narrowed)}
    beside = any(c.rpartition(".")[0] in parents for c in covered)
    return narrowed if beside else pattern


def grad_allreduce_rule(pattern: str, modules: list[nn.Module]) -> Any | None:
    """transformers' ``replicated_with_grad_allreduce`` for ``modules`` as a tpplan rule, or
    None where it is not a norm with weights (a module mixing batch rows could not read its
    input as split along the batch; a norm without weights has no gradient to sum)."""
    if not modules or not all(is_norm(m) and any(True for _ in m.parameters()) for m in modules):
        return None
    return (pattern, {"style": "sequence_parallel", "sequence_dim": 0, "use_local_output": True},
            f"transformers: {GRAD_ALLREDUCE} (weight replicated, its gradient summed over tp: "
            "each rank's covers its own heads)")
