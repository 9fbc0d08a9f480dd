"""Which packed projection ``suggest`` shards part by part (``packed_colwise``), and how.

A fused projection packs several outputs in one weight: Phi-3's ``qkv_proj`` (q, k and v
of ``num_attention_heads``, ``num_key_value_heads`` and ``num_key_value_heads`` heads),
``gate_up_proj`` (gate and up, equal halves, as in GLM and GLM-4). Its parts are named by
the attributes that size them, so the rule stays right on a shrunk or grown model of the
same architecture, and so those attributes become per-rank where the model reads them.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from ..models.dataflow import Call, Trace
from ..models.introspect import is_norm
from ..plan.patterns import generalize

__all__ = ["FUSED", "channelwise_readers", "experts_modules", "keeps_packed", "packed_parts",
           "whole_operand"]

FUSED = ("qkv", "gate_up", "packed")  # names of projections that pack several outputs


def _count(parent: nn.Module, name: str) -> int | None:
    value = getattr(parent, name, None)
    value = value if isinstance(value, int) else getattr(getattr(parent, "config", None), name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def packed_parts(colwise: list[nn.Module], names: list[str], rowwise: nn.Module | None,
                 parent: nn.Module | None) -> Any:
    """The ``parts`` option for the group's one fused projection, or None: not fused, or
    its parts cannot be told from the model (the projection is then gathered)."""
    if len(colwise) != 1 or parent is None:
        return None  # (one input projection twice as wide as the output's input is packed
        # whatever its name: Granite's shared_mlp.input_linear is chunked into gate and up)
    linear = colwise[0]
    if "qkv" in names[0]:
        head_dim = getattr(parent, "head_dim", None)
        heads = _count(parent, "num_attention_heads")
        kv = _count(parent, "num_key_value_heads")
        if isinstance(head_dim, int) and heads and kv and \
                linear.out_features == (heads + 2 * kv) * head_dim:
            return ["num_attention_heads", "num_key_value_heads", "num_key_value_heads"]
        return None
    if rowwise is not None and linear.out_features == 2 * rowwise.in_features:
        return 2
    return None


def experts_modules(branch: nn.Module) -> list[str]:
    """Paths (relative to ``branch``) of modules holding routed experts as 3-D parameters
    ``gate_up_proj`` [experts, 2 x inter, hidden] and ``down_proj`` [experts, hidden, inter]
    (transformers 5's MoE layout) that ``experts_colwise_rowwise`` shards: not transposed,
    without biases."""
    out = []
    for rel, module in branch.named_modules():
        own = dict(module.named_parameters(recurse=False))
        gate_up, down = own.get("gate_up_proj"), own.get("down_proj")
        if rel and gate_up is not None and down is not None and gate_up.dim() == down.dim() == 3 \
                and gate_up.shape[1] == 2 * down.shape[2] and not getattr(module, "is_transposed", False) \
                and not any("bias" in n for n in own):
            out.append(rel)
    return out


def channelwise_readers(trace: Trace, colwise: list[Call]) -> tuple[Call | None, list[tuple[str, Any, str]]]:
    """Modules with weights (not norms, linears) reading a colwise output. Scalar weights
    (Apertus's xIELU) run on this rank's slice, gradients summed over tp; any other (Inkling's
    ``k_sconv``, a convolution over ``k_proj``'s channels) is returned, to refuse."""
    rules: list[tuple[str, Any, str]] = []
    for c in colwise:
        for out in c.outputs:
            for user in trace.consumers(out):
                params = list(user.module.parameters())
                if isinstance(user.module, nn.Linear) or is_norm(user.module) or not params:
                    continue
                if any(p.numel() != 1 for p in params):
                    return user, []
                dim = len(user.shapes.get(out, (0, 0, 0))) - 1
                rule = (generalize(user.path), {"style": "sequence_parallel", "sequence_dim": dim,
                                                "use_local_output": True},
                        "scalar weights on each element of a sharded projection: weights "
                        "replicated, gradients summed over tp")
                rules += [rule] if rule[0] not in [r[0] for r in rules] else []
    return None, rules


def keeps_packed(suggested: list, member: str, hf_style: str) -> bool:
    """transformers gathers a packed projection (``colwise_gather_output``) and splits the
    input of the projection after it (``rowwise_split_input``); where the dataflow shards
    the packed parts instead (``packed_colwise``), its rules for both stand."""
    parent = member.rpartition(".")[0]
    packed = any(isinstance(st, dict) and st.get("style") == "packed_colwise"
                 and p.rpartition(".")[0] == parent for p, st, _ in suggested)
    return packed and hf_style in ("colwise_gather_output", "colwise_rep", "rowwise_split_input",
                                   "rowwise_rep")


def whole_operand(trace: Trace, colwise: list[Call], rowwise: Call, parent: str) -> str | None:
    """Where the code between a group's colwise and rowwise projections combines their output
    element by element with a tensor of the same shape from outside the group (Gemma 4's
    ``per_layer_input_gate(h) * per_layer_input``), sharding the projections would meet a
    slice with the whole: what reads that tensor, or None."""
    tainted = {o for c in colwise for o in c.outputs}
    shapes = {trace.shapes.get(o) for o in tainted}
    for path, ins, outs in trace.ops:
        if not (path == parent or path.startswith(parent + ".")) or \
                path == rowwise.path or path.startswith(rowwise.path + "."):
            continue
        mine = [i for i in ins if i in tainted]
        if not mine:
            continue
        if any(trace.shapes.get(i) in shapes for i in mine) and any(
                i not in tainted and trace.shapes.get(i) in shapes for i in ins):
            return path
        tainted.update(outs)
    return None
