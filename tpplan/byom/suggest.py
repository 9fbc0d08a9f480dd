"""Infer a Megatron-style plan from a model's own dataflow (``tpplan suggest``).

From one traced forward:

- the repeated blocks: the longest ``ModuleList`` of same-typed children;
- in a block, the sub-layers: the linear layers between one norm and the next;
- in a sub-layer, the linears that read the sub-layer's input (the first linear's input
  tensor) are *colwise*, and the last linear, which writes back to the residual stream, is
  *rowwise*; anything else is reported as undecided rather than guessed;
- the vocabulary embedding (rows = the head's output size) and the output head;
- sequence parallelism only where it is safe: the embedding's output must go to the first
  block and nowhere else (a model that derives positions or masks from it would see a
  sequence shard);
- integer attributes holding head counts (names with "head") for ``divide_by_tp``;
- FSDP units: the embedding, each block, the final norm with the head.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from ..models import build_model
from ..models.dataflow import Call, Trace, trace_forward
from ..models.introspect import find_blocks, first_block, is_norm, small_hf_fields
from ..plan.patterns import generalize
from ..plan.specs import ModelSpec

__all__ = ["Suggestion", "suggest_plan"]


@dataclass
class Suggestion:
    rules: list[tuple[str, Any, str]] = field(default_factory=list)  # pattern, style, comment
    divide_by_tp: list[str] = field(default_factory=list)
    units: list[Any] = field(default_factory=list)
    sequence_parallel: bool = False
    loss_parallel: bool = False
    blocks: str | None = None  # path of the ModuleList of repeated blocks
    notes: list[str] = field(default_factory=list)  # what could not be decided, and why


def _common_parent(paths: list[str]) -> str:
    parts = [p.split(".") for p in paths]
    common = []
    for seg in zip(*parts):
        if len(set(seg)) != 1:
            break
        common.append(seg[0])
    if len(common) == len(parts[0]):  # one linear: its parent
        common = common[:-1]
    return ".".join(common)


def _group(paths: list[str]) -> str:
    """``[a.x.wq, a.x.wk]`` -> ``a.*.{wq,wk}`` (generalized)."""
    parent = generalize(paths[0].rpartition(".")[0])
    names = [p.rpartition(".")[2] for p in paths]
    if len(names) == 1:
        return f"{parent}.{names[0]}"
    return f"{parent}.{{{','.join(names)}}}"


def _input_layouts(call: Call, hidden: int, src: str, dst: str) -> dict[str, Any]:
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


def _sub_layers(trace: Trace, block: str) -> list[tuple[Call | None, list[Call], list[Call]]]:
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


FUSED = ("qkv", "gate_up", "packed")  # names of projections that pack several outputs


def _inner_norm_rules(inner: list[Call], colwise: list[Call]) -> tuple[list, str | None]:
    """Rules for the norms inside a sub-layer, or why its projections must be gathered.

    A norm over ``head_dim`` after a colwise projection (Qwen3's ``q_norm``, on a
    ``(batch, seq, heads, head_dim)`` view) acts on whole heads, and each rank holds whole
    heads: it runs on this rank's heads as a DTensor sharded on the heads dimension with its
    weight replicated, so the weight's gradient is summed over tp. A norm over the whole
    projection (OLMo 2's, over heads × head_dim) needs every head: the projections are
    gathered instead."""
    rules, gather = [], None
    widths = {c.module.out_features for c in colwise}
    for c in inner:
        shape = c.shapes.get(c.inputs[0]) if c.inputs else None
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
    if fused and gather is None:
        gather = (f"'{generalize(fused[0].path)}' packs several projections in one weight; "
                  "sharding it by rows would give each rank a slice of one part, so its output "
                  "is gathered (colwise with replicated output)")
    return rules, gather


def _sp_norm(trace: Trace, norm: Call, block: str) -> tuple[str, Any, str]:
    """A norm on a sequence shard; its output stays a DTensor for the module that reads it
    (whose prepare_input gathers it), or is a local tensor where only code reads it (a
    post-norm's output goes straight into the residual add)."""
    readers = [c for c in trace.consumers(norm.outputs[0]) if c.path.startswith(block + ".")] \
        if norm.outputs else []
    if readers:
        return generalize(norm.path), "sequence_parallel", "norm on a sequence shard"
    return (generalize(norm.path), {"style": "sequence_parallel", "use_local_output": True},
            "norm on a sequence shard; its output goes to the residual add as a local shard")


def _whole_sequence(s: Suggestion, trace: Trace, norm: Call, block: str) -> None:
    """A sub-layer without linear layers (experts held as parameters) under sequence
    parallelism: the module reading the norm's output gets the whole sequence and hands
    back its shard, so its replicated weights see every token."""
    for c in trace.consumers(norm.outputs[0]) if norm.outputs else []:
        if c.path.startswith(block + ".") and not is_norm(c.module):
            opts = {"style": "prepare_input_output",
                    **_input_layouts(c, norm.outputs[0], "shard(1)", "replicate"),
                    "use_local_input": True, "output_layouts": "replicate", "desired_output_layouts": "shard(1)",
                    "use_local_output": True}
            s.rules.append((generalize(c.path), opts, "no projection to shard here: runs on "
                            "the whole sequence (replicated weights), hands back its shard"))
            s.notes.append(f"replicated on every tp rank: '{generalize(c.path)}' (its weights "
                           "are parameters, not linear layers tpplan can shard; experts under "
                           "TP are a later step)")
            return


def analyse(model: nn.Module, trace: Trace, blocks: str, sequence_parallel: str = "auto"
            ) -> Suggestion:
    """``sequence_parallel``: ``auto`` (end to end where safe), ``blocks`` (inside each block
    only: the block gathers its output back, for models that read the sequence length outside
    the blocks), or ``off``."""
    s = Suggestion(blocks=blocks)
    first = first_block(model, blocks)
    block_call = trace.first_call(first)
    outside = [c for c in trace.calls if not c.path.startswith(blocks + ".")]
    head = next((c for c in reversed(outside) if isinstance(c.module, nn.Linear)), None)
    vocab = head.module.out_features if head else None
    embed = next((c for c in outside if isinstance(c.module, nn.Embedding)
                  and c.module.num_embeddings == vocab), None)
    for c in outside:
        if isinstance(c.module, nn.Embedding) and c is not embed:
            s.notes.append(f"left '{c.path}' replicated: an embedding that is not the vocabulary "
                           "one (positions?) is small and read whole by every rank")
    if head is None or embed is None:
        s.notes.append("found no output head (a final Linear) with a matching vocabulary "
                       "embedding: embedding and head rules left out")
    tied = head is not None and embed is not None and head.module.weight is embed.module.weight
    if tied:
        s.notes.append(f"'{head.path}' shares its weight with '{embed.path}' (tied embeddings): "
                       "they cannot be sharded two ways; both left replicated")
        head = embed = None

    # Sequence parallel is safe only if the embedding output feeds the first block alone.
    hidden0 = embed.outputs[0] if embed and embed.outputs else None
    users = [c for c in trace.consumers(hidden0) if not c.path.startswith(first + ".")] \
        if hidden0 is not None else []
    s.sequence_parallel = sequence_parallel == "auto" and bool(block_call) and \
        hidden0 is not None and [c.path for c in users] == [first]
    if sequence_parallel == "auto" and hidden0 is not None and not s.sequence_parallel:
        others = ", ".join(sorted({c.path for c in users if c.path != first}))
        others = others or "code outside any module (it is combined with something before the first block)"
        s.notes.append(f"no sequence parallelism: the embedding output is also read by {others}, "
                       "which would see only a sequence shard")
    sp = s.sequence_parallel  # end to end: the residual stream is sequence-sharded
    inner = sp or sequence_parallel == "blocks"  # sequence-sharded inside the blocks
    if sequence_parallel == "blocks" and block_call is not None:
        hidden = block_call.args[0] if block_call.args and block_call.args[0] is not None else \
            next(iter(block_call.kwargs.values()))
        opts = {"style": "prepare_input_output",
                **_input_layouts(block_call, hidden, "replicate", "shard(1)"),
                "use_local_input": True, "output_layouts": "shard(1)",
                "desired_output_layouts": "replicate"}
        s.rules.append((f"{blocks}.*", opts, "sequence parallel inside each block; its output "
                        "is gathered back for the code between blocks"))
        s.sequence_parallel = True

    if embed:
        opts = {"style": "rowwise", "input_layouts": "replicate"}
        if sp:
            opts["output_layouts"] = "shard(1)"
        s.rules.append((embed.path, opts, "vocabulary rows split over tp"))

    for norm, linears, inner_norms in _sub_layers(trace, first):
        if inner and norm is not None:
            s.rules.append(_sp_norm(trace, norm, first))
        if not linears:
            if inner and norm is not None:
                _whole_sequence(s, trace, norm, first)
            continue
        x = linears[0].args[0] if linears[0].args else next(iter(linears[0].kwargs.values()))
        colwise = [c for c in linears if x in c.inputs]
        rest = [c for c in linears if c not in colwise]
        last = linears[-1]
        d = block_call.shapes.get(block_call.inputs[0], (None,))[-1] if block_call else None
        rowwise = last if last in rest and last.module.out_features == d else None
        for c in rest:
            if c is not rowwise:
                s.notes.append(f"undecided: '{generalize(c.path)}' is neither fed by the sub-layer's "
                               "input nor the last projection; left replicated")
        norm_rules, gather = _inner_norm_rules(inner_norms, colwise)
        if gather:
            s.notes.append(f"gathered: {gather}; attention or MLP runs whole on every rank")
        container = _common_parent([c.path for c in colwise])
        call = trace.first_call(container)
        needs_prepare = container != first and call is not None and \
            (inner or len(colwise) > 1)
        if needs_prepare:
            hidden = norm.outputs[0] if norm is not None else x
            src = "shard(1)" if inner else "replicate"
            opts = {"style": "prepare_input", **_input_layouts(call, hidden, src, "replicate")}
            why = ("one all-gather of the sequence, shared by " if inner else
                   "siblings share one replicated input: one gradient all-reduce for ")
            s.rules.append((generalize(container), opts,
                            why + ", ".join(c.path.rpartition(".")[2] for c in colwise)))
        if colwise:
            opts = {"style": "colwise", "output_layouts": "replicate"} if gather else "colwise"
            s.rules.append((_group([c.path for c in colwise]), opts,
                            "reads the sub-layer input" + ("; output gathered" if gather else "")))
        if not gather:
            s.rules += norm_rules
        if rowwise is not None:
            opts = {"style": "rowwise"}
            if gather:
                opts["input_layouts"] = "replicate"
            if inner:
                opts["output_layouts"] = "shard(1)"
            s.rules.append((generalize(rowwise.path), opts if len(opts) > 1 else "rowwise",
                            "writes back to the residual stream"))
            if call is not None and not gather:
                s.divide_by_tp += [f"{generalize(container)}.{name}"
                                   for name in _head_counts(call.module, colwise)]

    final_norms = [c for c in outside if is_norm(c.module) and head and
                   trace.calls.index(c) < trace.calls.index(head) and
                   trace.calls.index(c) > trace.calls.index(block_call)]
    if sp:
        for c in final_norms:
            s.rules.append((c.path, "sequence_parallel", "final norm on a sequence shard"))
    if head:
        opts = {"style": "colwise", "use_local_output": False}
        if sp:
            opts = {"style": "colwise", "input_layouts": "shard(1)", "use_local_output": False}
        s.rules.append((head.path, opts, "logits stay vocabulary-sharded for loss_parallel"))
        s.loss_parallel = True

    if embed:
        s.units.append(embed.path)
    s.units.append(f"{blocks}.*")
    tail = [c.path for c in final_norms] + ([head.path] if head else [])
    if tail:
        s.units.append(tail if len(tail) > 1 else tail[0])
    return s


def suggest_plan(spec: ModelSpec, sequence_parallel: str = "auto") -> Suggestion:
    """Trace the plan's model and infer its rules."""
    model = build_model(spec, "meta")
    blocks = find_blocks(model)
    if blocks is None:
        s = Suggestion()
        s.notes.append("found no repeated blocks (a ModuleList of same-typed modules)")
        return s
    tokens = torch.randint(0, 2, (2, 16), device="meta")
    try:
        trace = trace_forward(model, tokens)
    except (RuntimeError, NotImplementedError):
        if not spec.is_hf:
            raise
        # HF mask code reads tensor values; trace a toy-width CPU copy of the architecture
        # (the dataflow does not depend on widths).
        from ..models.hf import build_hf, hf_config

        config = hf_config(spec)
        small = config.__class__(**{**config.to_dict(), **small_hf_fields(config, tp=2)})
        with torch.device("cpu"):
            model = build_hf(spec, small)
        trace = trace_forward(model, torch.randint(0, small.vocab_size, (2, 16)))
    return analyse(model, trace, blocks, sequence_parallel)
