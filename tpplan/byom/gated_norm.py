"""Gated norms: a block's norm that holds a norm and a small MLP of its own (AXK2's
``input_layernorm``: ``y = norm(x); y * sigmoid(mlp(y))``, Megatron's ``GatedNormWrapper``).

Like a plain norm it reads the residual stream and opens a sub-layer, and it acts on each
token alone (its leaves are norms and linear layers). So it runs where a norm runs: whole
on every rank without sequence parallelism, and on the sequence shard with it, every leaf
holding its weights as replicated DTensors (``sequence_parallel``: the input a DTensor split
on the sequence, the weights' gradients summed over tp). PyTorch's ``SequenceParallel``
re-registers the parameters of the module it is given by name, which a module with children
does not allow (``norm.weight``), hence a rule per leaf and none on the gated norm itself.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from ..models.dataflow import Call, Trace
from ..models.introspect import is_norm
from ..plan.patterns import generalize

__all__ = ["is_gated_norm", "gated_norm_sp_rules"]


def is_gated_norm(module: nn.Module) -> bool:
    """A module named as a norm, holding a norm, whose leaves with weights are all norms or
    linear layers (so it treats every token alone)."""
    leaves = [m for m in module.modules() if not list(m.children())
              and any(True for _ in m.parameters(recurse=False))]
    return "norm" in type(module).__name__.lower() and bool(list(module.children())) and \
        any(is_norm(m) for m in leaves) and \
        all(is_norm(m) or isinstance(m, nn.Linear) for m in leaves)


def gated_norm_sp_rules(trace: Trace, norm: Call, block: str) -> list[tuple[str, Any, str]]:
    """Its rules on a sequence shard: each leaf with weights ``sequence_parallel``; where
    nothing in the block reads its output (a post-norm's goes into the residual add), a
    ``prepare_output`` hands back the local shard."""
    rules: list[tuple[str, Any, str]] = [
        (generalize(f"{norm.path}.{rel}"), "sequence_parallel",
         "inside a gated norm, on a sequence shard: weights replicated, gradients summed over tp")
        for rel, m in norm.module.named_modules()
        if rel and not list(m.children()) and any(True for _ in m.parameters(recurse=False))]
    readers = [c for c in trace.consumers(norm.outputs[0]) if c.path.startswith(block + ".")] \
        if norm.outputs else []
    if not readers:
        rules.append((generalize(norm.path), {"style": "prepare_output",
                                              "output_layouts": "shard(1)",
                                              "desired_output_layouts": "shard(1)",
                                              "use_local_output": True},
                      "gated norm on a sequence shard; its output goes to the residual add as "
                      "a local shard"))
    return rules
