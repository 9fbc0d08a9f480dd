"""Why a rule of transformers' ``base_model_tp_plan`` cannot become a tpplan rule on a given
model (``tpplan import-hf``): it names a parameter, matches nothing, holds experts in a
layout tpplan does not shard, is a style PyTorch cannot apply to that module type, or asks
for nothing tpplan needs a rule for (transformers' ``replicate``)."""

from __future__ import annotations

import torch.nn as nn

from ..plan.patterns import compile_pattern
from ..plan.styles import ALIASES
from .packing import experts_modules

__all__ = ["unshardable"]


def unshardable(pattern: str, style: str, modules: dict[str, nn.Module],
                 params: set[str]) -> str | None:
    """Why transformers' rule cannot be a tpplan rule on this model, or None."""
    rx = compile_pattern(pattern)
    hits = [m for p, m in modules.items() if rx.fullmatch(p)]
    if not hits and any(rx.fullmatch(p) for p in params):
        return (f"'{pattern}' ({style}) is a parameter, not a module (experts held as one "
                "tensor): the experts module's own rule (experts_colwise_rowwise, transformers' "
                "moe_tp_experts) shards it")
    if not hits:
        return (f"'{pattern}' ({style}) matches no module of this configuration (transformers' "
                "plan covers variants of the architecture); left out")
    name = ALIASES.get(style, (style, {}))[0]
    if name == "experts_colwise_rowwise" and not experts_modules(nn.ModuleDict({"e": hits[0]})):
        return (f"'{pattern}' ({style}): {type(hits[0]).__name__} holds its experts in a layout "
                "experts_colwise_rowwise does not shard (transposed, biases, no gate); replicated")
    if name in ("colwise", "rowwise") and not isinstance(hits[0], (nn.Linear, nn.Embedding)):
        return (f"'{pattern}' ({style}) is a {type(hits[0]).__name__}, which PyTorch's "
                f"{name} cannot shard: left replicated")
    return (f"'{pattern}' (replicate): transformers' style also hands it whole inputs; a module "
            "without a rule is whole on every rank with plain tensors in and out: no rule") \
        if name == "replicate" else None
