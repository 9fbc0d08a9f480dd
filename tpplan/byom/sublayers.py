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
from .packing import FUSED, channelwise_readers, experts_modules, packed_parts

__all__ = ["input_layouts", "sub_layers", "sp_norm", "sub_layer_rules", "common_parent",
           "group_pattern", "whole_sequence_modules"]

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


def input_layouts(call: Call, hidden: int, src: str, dst: str) -> dict[str, Any]:
    """prepare_input options for a module called with the hidden states ``hidden``."""
    for name, tid in call.kwargs.items():
        if tid == hidden:
            return {"input_kwarg_layouts": {name: src}, "desired_input_kwarg_layouts": {name: dst}}
    layouts = [src if a == hidden else None for a in call.args]
    if len(layouts) == 1:
        return {"input_layouts": src, "desired_input_layouts": dst}
    return {"input_layouts": layouts,
            "desired_input_layouts": [dst if x else None for x in layouts]}


def _head_counts(module: nn.Module, colwise: list[Call]) -> list[str]:
    """Integer attributes that look like head counts: they must become per-rank under TP."""
    return [name for name, value in vars(module).items()
            if isinstance(value, int) and not isinstance(value, bool) and value > 1
            and "head" in name and not any(w in name for w in ("dim", "size", "group"))
            and all(c.module.out_features % value == 0 for c in colwise)]


def sub_layers(trace: Trace, block: str) -> list[tuple[Call | None, list[Call], list[Call]]]:
    """(the norm that opens it, its linear calls, the norms inside it) for each sub-layer of
    one block. Only a norm that is a direct child of the block reads the residual stream and
    opens a sub-layer; a norm deeper down (``self_attn.q_norm``) acts on a projection's
    output, inside the sub-layer."""
    out: list[tuple[Call | None, list[Call], list[Call]]] = [(None, [], [])]
    for call in trace.within(block):
        if is_norm(call.module):
            if call.path.rpartition(".")[0] == block:
                out.append((call, [], []))
            else:
                out[-1][2].append(call)
        elif isinstance(call.module, nn.Linear):
            out[-1][1].append(call)
    return [(norm, lins, inner) for norm, lins, inner in out if lins or norm is not None]


def sp_norm(trace: Trace, norm: Call, block: str) -> Rule:
    """A norm on a sequence shard; its output stays a DTensor for the module that reads it
    (whose prepare_input gathers it), or is a local tensor where only code reads it (a
    post-norm's output goes straight into the residual add)."""
    readers = [c for c in trace.consumers(norm.outputs[0]) if c.path.startswith(block + ".")] \
        if norm.outputs else []
    # a norm whose output the block's code also reads (MiniMax adds it to the residual
    # stream, as a post-norm) hands a local shard: its readers' rules take shard(1) inputs
    if readers and block not in trace.code_reads.get(norm.outputs[0], ()):
        return generalize(norm.path), "sequence_parallel", "norm on a sequence shard"
    return (generalize(norm.path), {"style": "sequence_parallel", "use_local_output": True},
            "norm on a sequence shard; its output goes to the residual add as a local shard")


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


def _whole_sequence(notes: list[str], trace: Trace, branch: Call, hidden: int,
                    why: str, every: bool = False) -> Rule:
    """Under sequence parallelism, a branch tpplan cannot shard on the sequence (experts held
    as parameters, a router reading flattened tokens) gets the whole sequence and hands
    back its shard: its replicated weights see every token."""
    notes.append(f"'{generalize(branch.path)}' runs on the whole sequence: {why}")
    n = branch.arity - 1  # attention's weights pass through as they are; ``every`` output
    rest, back_rest = (["replicate"] * n, ["shard(1)"] * n) if every else ([None] * n, [None] * n)
    out, back = (["replicate", *rest], ["shard(1)", *back_rest]) if n else ("replicate", "shard(1)")
    return (generalize(branch.path),
            {"style": "prepare_input_output", **input_layouts(branch, hidden, "shard(1)",
                                                               "replicate"),
             "use_local_input": True, "output_layouts": out,
             "desired_output_layouts": back, "use_local_output": True},
            "the whole sequence in, its shard back out")


def whole_sequence_modules(s: Any, trace: Trace, block: str, rules: list[Rule]) -> list[Rule]:
    """Under sequence parallelism inside a block, a direct child of the block with weights and
    no rule on it or inside it (Inkling's ``attn_sconv``, a convolution along the sequence) may
    mix tokens: it gets the whole sequence and hands back its shard (of every output)."""
    ruled = [p for p, _, _ in rules]
    out = []
    for c in trace.within(block):
        if c.path.rpartition(".")[0] != block or is_norm(c.module) or not c.inputs or \
                not any(True for _ in c.module.parameters()):
            continue
        pattern = generalize(c.path)
        if any(p == pattern or p.startswith(pattern + ".") for p in ruled + [r[0] for r in out]):
            continue
        hidden = c.args[0] if c.args and c.args[0] is not None else c.inputs[0]
        out.append(_whole_sequence(s.notes, trace, c, hidden, "it has weights of its own and "
                                   "may mix tokens (a convolution along the sequence?)", True))
    return out


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
        nested = {p for p in groups if p.startswith(c.path)} - {c.path}
        loose = [n for n, _ in c.module.named_parameters()
                 if not isinstance(c.module.get_submodule(n.rpartition(".")[0]), nn.Linear)
                 and not is_norm(c.module.get_submodule(n.rpartition(".")[0]))]
        if nested or loose or not any(p.startswith(c.path) for p in groups):
            whole.add(c.path)
            # the whole sequence however the branch is reached: from the norm, or from code
            # (Qwen4-exp's hyper-connection mix, Llama 4's residual): its first tensor input
            x = hidden if hidden in c.inputs else (c.args[0] if c.args and c.args[0]
                                                   is not None else next(iter(c.inputs), None))
            if inner and x is not None:
                rules.append(_whole_sequence(s.notes, trace, c, x, (
                    "it routes tokens (experts held as parameters, a router), which tpplan does "
                    "not split on the sequence")
                    if loose else "its projections do not read the sequence as such"))
            rules += [(generalize(f"{c.path}.{rel}"), "experts_colwise_rowwise",
                       "routed experts: each expert's intermediate dimension split over tp (gate "
                       "and up halves separately), outputs summed over tp; the router replicated")
                      for rel in experts_modules(c.module)]
    for parent, group in groups.items():
        seq = inner and not any(parent.startswith(w) for w in whole)
        rules += _group_rules(s, trace, block, parent, group, inner_norms, d, seq)
    return rules


def _group_rules(s: Any, trace: Trace, block: str, parent: str, group: list[Call],
                 inner_norms: list[Call], d: int | None, seq: bool) -> list[Rule]:
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
    holder = trace.first_call(parent) if parent != block else None
    own = [n for n, p in holder.module.named_parameters() if p.numel() > 1 and not isinstance(
        m := holder.module.get_submodule(n.rpartition(".")[0]), nn.Linear) and not is_norm(m)] \
        if holder is not None else []
    if own:  # Beam's gate_bias[heads], a Mamba mixer's conv1d and A_log: they would meet a
        # slice of what they cover
        s.notes.append(f"left replicated: '{generalize(parent)}' uses weights of its own beside "
                       f"its projections ({', '.join(own)}); tpplan cannot shard them with them")
        return rules
    if channelwise:
        s.notes.append(f"left replicated: {group_pattern([c.path for c in colwise])} feed "
                       f"'{generalize(channelwise.path)}' ({type(channelwise.module).__name__}), "
                       "which holds weights over the projection's channels (a per-channel "
                       "convolution?); tpplan has no style that shards it with the projection")
        return rules
    mine = [n for n in inner_norms if n.path.startswith(parent + ".")]
    container = common_parent([c.path for c in colwise])
    call = trace.first_call(container)
    parts = packed_parts([c.module for c in colwise], [c.path.rpartition(".")[2] for c in colwise],
                         rowwise.module, call.module if call is not None else None)
    norm_rules, gather = _inner_norm_rules(mine, colwise, parts is not None)
    if gather:
        s.notes.append(f"gathered: {gather}; this part runs whole on every rank")
        parts = None
    if container != block and call is not None and (seq or len(colwise) > 1):
        src = "shard(1)" if seq else "replicate"
        opts = {"style": "prepare_input", **input_layouts(call, x if not call.inputs or x in
                                                          call.inputs else call.inputs[0],
                                                          src, "replicate")}
        why = ("one all-gather of the sequence, shared by " if seq else
               "siblings share one replicated input: one gradient all-reduce for ")
        if any(u.path.startswith(container + ".") and u not in colwise
               for u in trace.consumers(x)):  # plain modules read it too (DeepSeek's indexer)
            opts["use_local_output"], why = True, "a plain tensor: " + why
        rules.append((generalize(container), opts,
                      why + ", ".join(c.path.rpartition(".")[2] for c in colwise)))
    opts = {"style": "colwise", "output_layouts": "replicate"} if gather else "colwise"
    if parts is not None:
        opts = {"style": "packed_colwise", "parts": parts}
    rules.append((group_pattern([c.path for c in colwise]), opts,
                  "reads the group's input" + ("; output gathered" if gather else "") +
                  ("; packs several projections: each part split over tp, every rank gets its "
                   "slice of each" if parts is not None else "")))
    if not gather:
        rules += norm_rules + scalar_rules
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
