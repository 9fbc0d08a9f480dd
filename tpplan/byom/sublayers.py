"""The rules inside one block for ``tpplan suggest``: its sub-layers, and in each the
projections to shard, the norms acting inside them, and what must stay whole.

A sub-layer runs from a norm that reads the residual stream (a direct child of the block)
to the next. Its linear layers are taken in groups, one per module that holds them
(``self_attn``, ``mlp``, ``mlp.shared_expert``): in a group, the linears that read the
group's input are *colwise* and the last one, writing back the hidden width, is *rowwise*.
Cohere's and Phi's parallel attention and MLP are two groups of one sub-layer; an MoE
block's shared expert is a group of its own, its routed experts a rule of their own."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from ..models.dataflow import Call, Trace
from ..models.introspect import is_norm
from ..plan.patterns import generalize
from .gated_norm import is_gated_norm
from .head_rules import per_head_params, with_head_params
from .packing import FUSED, channelwise_readers, experts_modules, packed_parts, whole_operand
from .seq_rules import input_layouts, whole_sequence

__all__ = ["sub_layers", "sub_layer_rules", "common_parent",
           "group_pattern"]

Rule = tuple[str, Any, str]


def common_parent(paths: list[str]) -> str:
    parts = [p.split(".") for p in paths]
    common = []
    for seg in zip(*parts):
        if len(set(seg)) != 1:
            break
        common.append(seg[0])
    if len(common) == len(parts[0]):  # one linear: its parent
        common = common[:-1]
    return ".".join(common)


def group_pattern(paths: list[str]) -> str:
    """``[a.x.wq, a.x.wk]`` -> ``a.*.{wq,wk}`` (generalized)."""
    parent = generalize(paths[0].rpartition(".")[0])
    names = [p.rpartition(".")[2] for p in paths]
    if len(names) == 1:
        return f"{parent}.{names[0]}"
    return f"{parent}.{{{','.join(names)}}}"


def _head_counts(module: nn.Module, colwise: list[Call]) -> list[str]:
    """Integer attributes that look like head counts: they must become per-rank under TP."""
    return [name for name, value in vars(module).items()
            if isinstance(value, int) and not isinstance(value, bool) and value > 1
            and "head" in name and not any(w in name for w in ("dim", "size", "group"))
            and all(c.module.out_features % value == 0 for c in colwise)]


def sub_layers(trace: Trace, block: str) -> list[tuple[Call | None, list[Call], list[Call]]]:
    """(the norm that opens it, its linear calls, the norms inside it) per sub-layer of one
    block. A norm that is the block's child (or an item of a list that is) opens one; a norm
    deeper down (``self_attn.q_norm``) acts on a projection's output, inside it."""
    out: list[tuple[Call | None, list[Call], list[Call]]] = [(None, [], [])]
    gated = None  # a gated norm's own modules act per token with it (tpplan.byom.gated_norm)
    for call in trace.within(block):
        if gated and call.path.startswith(gated + "."):
            continue
        if call.path.rpartition(".")[0] == block and is_gated_norm(call.module):
            gated = call.path
            out.append((call, [], []))
        elif is_norm(call.module):
            rel = call.path[len(block) + 1:].split(".")  # LongCat's input_layernorm.0
            if len(rel) == 1 or (len(rel) == 2 and rel[1].isdigit()):
                out.append((call, [], []))
            else:
                out[-1][2].append(call)
        elif isinstance(call.module, nn.Linear):
            out[-1][1].append(call)
    return [(norm, lins, inner) for norm, lins, inner in out if lins or norm is not None]


def _inner_norm_rules(inner: list[Call], colwise: list[Call], packed: bool = False
                      ) -> tuple[list[Rule], str | None]:
    """Rules for the norms inside a group, or why its projections must be gathered.

    A norm over ``head_dim`` after a colwise projection (Qwen3's ``q_norm``, on a
    ``(batch, seq, heads, head_dim)`` view) acts on whole heads, and each rank holds whole
    heads: it runs on this rank's heads as a DTensor sharded on the heads dimension with its
    weight replicated, so the weight's gradient is summed over tp. A norm over the whole
    projection (OLMo 2's, over heads × head_dim) needs every head: the projections are
    gathered instead."""
    rules: list[Rule] = []
    gather = None
    widths = {c.module.out_features for c in colwise}
    for c in inner:
        shape = c.shapes.get(c.inputs[0]) if c.inputs else None
        if len(c.inputs) > 1:  # a gated norm (Bailing's o_norm): the rule passes one input
            gather = (f"'{generalize(c.path)}' takes {len(c.inputs)} inputs (a gated norm), "
                      "which the per-head norm rule cannot pass on: q/k/v are gathered")
            continue
        if not shape or shape[-1] in widths or len(shape) < 3:
            gather = (f"'{generalize(c.path)}' normalizes the whole projection output, across "
                      "heads: q/k/v are gathered (colwise with replicated output) so it sees "
                      "every head")
            continue
        rules.append((generalize(c.path), {"style": "sequence_parallel",
                                           "sequence_dim": len(shape) - 2,
                                           "use_local_output": True},
                      f"per-head norm over head_dim {shape[-1]}: runs on this rank's heads "
                      f"(dimension {len(shape) - 2}), weight replicated, gradient summed over tp"))
    fused = [c for c in colwise if any(f in c.path.rpartition(".")[2] for f in FUSED)]
    if fused and gather is None and not packed:
        gather = (f"'{generalize(fused[0].path)}' packs several projections in one weight; "
                  "sharding it by rows would give each rank a slice of one part, so its output "
                  "is gathered (colwise with replicated output)")
    return rules, gather


def _branch(path: str, block: str) -> str:
    """The block's direct child that holds ``path`` (``layers.0.mlp`` for its experts)."""
    rest = path[len(block) + 1:]
    return f"{block}.{rest.split('.')[0]}"


def sub_layer_rules(s: Any, model: nn.Module, trace: Trace, block: str, block_call: Call | None,
                    norm: Call | None, linears: list[Call], inner_norms: list[Call],
                    inner: bool) -> list[Rule]:
    """Every rule of one sub-layer (``inner``: sequence-sharded inside the block); notes and
    ``divide_by_tp`` entries go onto the suggestion ``s``."""
    rules: list[Rule] = []
    d = block_call.shapes.get(block_call.inputs[0], (None,))[-1] if block_call else None
    hidden = norm.outputs[0] if norm is not None and norm.outputs else None
    groups: dict[str, list[Call]] = {}
    for c in linears:
        groups.setdefault(c.path.rpartition(".")[0], []).append(c)
    # Branches (direct children of the block) holding more than plain linear groups: MoE.
    whole = set()
    for c in ([trace.first_call(_branch(c.path, block)) for c in linears] +
              ([c for c in trace.consumers(hidden) if c.path.rpartition(".")[0] == block]
               if hidden is not None else [])):
        if c is None or c.path in whole or is_norm(c.module):
            continue
        nested = {p for p in groups if p.startswith(c.path + ".")} - {c.path}
        loose = [n for n, _ in c.module.named_parameters()
                 if not isinstance(c.module.get_submodule(n.rpartition(".")[0]), nn.Linear)
                 and not is_norm(c.module.get_submodule(n.rpartition(".")[0]))]
        if nested or loose or not any(f"{p}.".startswith(c.path + ".") for p in groups):
            whole.add(c.path)
            # the whole sequence however the branch is reached: from the norm, or from code
            # (Qwen4-exp's hyper-connection mix, Llama 4's residual): its first tensor input
            x = hidden if hidden in c.inputs else (c.args[0] if c.args and c.args[0]
                                                   is not None else next(iter(c.inputs), None))
            if inner and x is not None:
                rules.append(whole_sequence(s.notes, trace, c, x, (
                    "it routes tokens (experts held as parameters, a router), which tpplan does "
                    "not split on the sequence")
                    if loose else "its projections do not read the sequence as such"))
            rules += [(generalize(f"{c.path}.{rel}"), "experts_colwise_rowwise",
                       "routed experts: each expert's intermediate dimension split over tp (gate "
                       "and up halves separately), outputs summed over tp; the router replicated")
                      for rel in experts_modules(c.module)]
    for parent, group in groups.items():
        seq = inner and not any(f"{parent}.".startswith(w + ".") for w in whole)
        rules += _group_rules(s, trace, block, parent, group, inner_norms, d, seq)
    return rules


def _unshardable(trace: Trace, block: str, parent: str, colwise: list[Call], rest: list[Call],
                 rowwise: Call, channelwise: Call | None) -> tuple[str | None, list[str]]:
    """Why a group whose projections close back to the hidden width still stays replicated
    (None: it can be sharded), and its parent's per-head parameters, split with the heads."""
    holder = trace.first_call(parent) if parent != block else None
    own = [n for n, p in holder.module.named_parameters() if p.numel() > 1 and not isinstance(
        m := holder.module.get_submodule(n.rpartition(".")[0]), nn.Linear) and not is_norm(m)] \
        if holder is not None else []
    heads = per_head_params(holder.module, [c.module for c in colwise]) \
        if own and rest == [rowwise] else []  # (not beside a linear left whole: Doge's dt_proj)
    own = [n for n in own if n not in heads]  # Beam's gate_bias[heads]: split with the heads
    if own:  # a Mamba mixer's conv1d and A_log: they would meet a slice of what they cover
        return (f"left replicated: '{generalize(parent)}' uses weights of its own beside "
                f"its projections ({', '.join(own)}); tpplan cannot shard them with them"), heads
    if channelwise:
        return (f"left replicated: {group_pattern([c.path for c in colwise])} feed "
                f"'{generalize(channelwise.path)}' ({type(channelwise.module).__name__}), "
                "which holds weights over the projection's channels (a per-channel "
                "convolution?); tpplan has no style that shards it with the projection"), heads
    changed = next((trace.modified[o] for o in rowwise.outputs if o in trace.modified), None)
    if changed is not None:  # a rowwise output is a view of a DTensor's local tensor
        return (f"left replicated: the code of '{generalize(changed)}' modifies the output "
                f"of '{generalize(rowwise.path)}' in place, which autograd forbids on the "
                "local view of a sharded projection's output"), heads
    mixed = whole_operand(trace, colwise, rowwise, parent)
    if mixed is not None:
        return (f"left replicated: the code of '{generalize(mixed)}' combines the output "
                f"of {group_pattern([c.path for c in colwise])} element by element with "
                "a whole tensor of its shape, which would meet a slice"), heads
    return None, heads


def _prepare_input(trace: Trace, call: Call, container: str, colwise: list[Call], x: Any, seq: bool) -> Rule:
    """The ``prepare_input`` of the colwise projections' parent: one all-gather of the
    sequence (``seq``) or one replicated input, shared by all of them."""
    src = "shard(1)" if seq else "replicate"
    opts = {"style": "prepare_input", **input_layouts(call, x if not call.inputs or x in
                                                      call.inputs else call.inputs[0],
                                                      src, "replicate")}
    why = ("one all-gather of the sequence, shared by " if seq else
           "siblings share one replicated input: one gradient all-reduce for ")
    if any(u.path.startswith(container + ".") and u not in colwise
           for u in trace.consumers(x)):  # plain modules read it too (DeepSeek's indexer)
        opts["use_local_output"], why = True, "a plain tensor: " + why
    return (generalize(container), opts,
            why + ", ".join(c.path.rpartition(".")[2] for c in colwise))


def _group_rules(s: Any, trace: Trace, block: str, parent: str, group: list[Call],
                 inner_norms: list[Call], d: int | None, seq: bool) -> list[Rule]:
    """The rules of one group of linears under ``parent``: colwise those reading the group's
    input, rowwise the last (back to the hidden width ``d``), with the parent's
    ``prepare_input``, its norms and per-head parameters; none, with a note, where the group
    cannot be sharded."""
    rules: list[Rule] = []
    first = group[0]
    x = first.args[0] if first.args else next(iter(first.kwargs.values()))
    colwise = [c for c in group if x in c.inputs]
    rest = [c for c in group if c not in colwise]
    last = group[-1]
    rowwise = last if last in rest and last.module.out_features == d else None
    if rowwise is None:
        s.notes.append(f"left replicated: {', '.join(repr(generalize(c.path)) for c in group)} "
                       "(no projection back to the hidden width closes the group)")
        return rules
    for c in rest:
        if c is not rowwise:
            s.notes.append(f"undecided: '{generalize(c.path)}' is neither fed by the group's "
                           "input nor the last projection; left replicated")
    channelwise, scalar_rules = channelwise_readers(trace, colwise)
    why, heads = _unshardable(trace, block, parent, colwise, rest, rowwise, channelwise)
    if why:
        s.notes.append(why)
        return rules
    mine = [n for n in inner_norms if n.path.startswith(parent + ".")  # not on the rowwise
            and not set(n.inputs) & set(rowwise.outputs)]  # output: whole (Gemma 3n's LAuReL)
    container = common_parent([c.path for c in colwise])
    call = trace.first_call(container)
    parts = packed_parts([c.module for c in colwise], [c.path.rpartition(".")[2] for c in colwise],
                         rowwise.module, call.module if call is not None else None)
    norm_rules, gather = _inner_norm_rules(mine, colwise, parts is not None)
    if gather:
        s.notes.append(f"gathered: {gather}; this part runs whole on every rank")
        parts = None
    if container != block and call is not None and (seq or len(colwise) > 1):
        rules.append(_prepare_input(trace, call, container, colwise, x, seq))
    opts = {"style": "colwise", "output_layouts": "replicate"} if gather else "colwise"
    if parts is not None:
        opts = {"style": "packed_colwise", "parts": parts}
    rules.append((group_pattern([c.path for c in colwise]), opts,
                  "reads the group's input" + ("; output gathered" if gather else "") +
                  ("; packs several projections: each part split over tp, every rank gets its "
                   "slice of each" if parts is not None else "")))
    if not gather:
        rules += norm_rules + scalar_rules
        rules = with_head_params(rules, generalize(parent), heads) if heads else rules
    row = {"style": "rowwise"}
    if gather:
        row["input_layouts"] = "replicate"
    if seq:
        row["output_layouts"] = "shard(1)"
    rules.append((generalize(rowwise.path), row if len(row) > 1 else "rowwise",
                  "writes back to the residual stream"))
    if call is not None and not gather:
        per_rank = parts if isinstance(parts, list) else []  # packed_colwise divides these
        s.divide_by_tp += [f"{generalize(container)}.{name}"
                           for name in _head_counts(call.module, colwise) if name not in per_rank]
    return rules
