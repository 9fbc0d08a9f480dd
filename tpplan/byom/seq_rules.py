"""Rules that hand sequence shards around under sequence parallelism (``tpplan suggest``):
which inputs a block or a module gets as a shard, the norms that run on a shard, and the
modules that must see the whole sequence (they route tokens or may mix them) and hand back
their shard."""

from __future__ import annotations

from typing import Any

from ..models.dataflow import Call, Trace
from ..models.introspect import is_norm
from ..plan.patterns import compile_pattern, generalize

__all__ = ["input_layouts", "sequence_inputs", "sp_norm", "whole_sequence",
           "whole_sequence_modules"]

Rule = tuple[str, Any, str]


def input_layouts(call: Call, hidden: int | set[int], src: str, dst: str) -> dict[str, Any]:
    """prepare_input options for a module called with the hidden states ``hidden`` (one
    tensor id, or several handed over alike)."""
    ids = hidden if isinstance(hidden, set) else {hidden}
    kw = {name: tid for name, tid in call.kwargs.items() if tid in ids}
    layouts = [src if a in ids else None for a in call.args]
    out: dict[str, Any] = {}
    if kw:
        out = {"input_kwarg_layouts": {n: src for n in kw},
               "desired_input_kwarg_layouts": {n: dst for n in kw}}
    if not any(layouts) and kw:
        return out
    if len(layouts) == 1:
        return {"input_layouts": src, "desired_input_layouts": dst, **out}
    return {"input_layouts": layouts,
            "desired_input_layouts": [dst if x else None for x in layouts], **out}


def sequence_inputs(trace: Trace, call: Call, hidden: int) -> set[int]:
    """``hidden`` and the other inputs of a block shaped like it on (batch, sequence) that the
    block's own code reads (Gemma 4's ``per_layer_input``, multiplied into the residual
    stream): under sequence parallelism each is handed over as a sequence shard alike."""
    lead = call.shapes.get(hidden, ())[:2]
    return {hidden} | {t for t in call.inputs if len(call.shapes.get(t, ())) >= 3
                       and call.shapes[t][:2] == lead and call.path in trace.code_reads.get(t, ())}


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


def whole_sequence(notes: list[str], trace: Trace, branch: Call, hidden: int,
                    why: str, every: bool = False) -> Rule:
    """Under sequence parallelism, a branch tpplan cannot shard on the sequence (experts held
    as parameters, a router reading flattened tokens) gets the whole sequence and hands
    back its shard: its replicated weights see every token."""
    notes.append(f"'{generalize(branch.path)}' runs on the whole sequence: {why}")
    n = branch.arity - 1  # attention's weights pass through as they are; ``every`` output
    rest, back_rest = (["replicate"] * n, ["shard(1)"] * n) if every else ([None] * n, [None] * n)
    out, back = (["replicate", *rest], ["shard(1)", *back_rest]) if n else ("replicate", "shard(1)")
    lead = (trace.shapes.get(hidden) or branch.shapes.get(hidden, ()))[:2]
    seq = {hidden} | {t for t in branch.inputs if len(branch.shapes.get(t, ())) >= 3
                      and branch.shapes[t][:2] == lead}  # Inkling 2's block_states too
    opts = {"style": "prepare_input_output", **input_layouts(branch, seq, "shard(1)",
                                                              "replicate"),
            "use_local_input": True, "output_layouts": out,
            "desired_output_layouts": back, "use_local_output": True}
    first = trace.shapes.get(branch.outputs[0], ()) if branch.outputs else ()
    if len(lead) == 2 and len(first) == 2 and first[0] == lead[0] * lead[1]:
        opts["flat_tokens"] = True  # Llama 4's MoE returns (batch x sequence, hidden)
    return (generalize(branch.path), opts, "the whole sequence in, its shard back out" +
            (" (its tokens come out flattened)" if "flat_tokens" in opts else ""))


def whole_sequence_modules(s: Any, trace: Trace, block: str, rules: list[Rule]) -> list[Rule]:
    """Under sequence parallelism inside a block, a direct child of the block with weights and
    no rule on it or inside it (Inkling's ``attn_sconv``, a convolution along the sequence) may
    mix tokens: it gets the whole sequence and hands back its shard (of every output)."""
    out = []
    for c in trace.within(block):
        if c.path.rpartition(".")[0] != block or is_norm(c.module) or not c.inputs or \
                not any(True for _ in c.module.parameters()):
            continue
        below = [x.path for x in trace.within(c.path)] + [c.path]  # a brace rule covers some
        if any(compile_pattern(p).fullmatch(x) for p, _, _ in rules + out for x in below):
            continue
        hidden = c.args[0] if c.args and c.args[0] is not None else c.inputs[0]
        out.append(whole_sequence(s.notes, trace, c, hidden, "it has weights of its own and "
                                   "may mix tokens (a convolution along the sequence?)", True))
    return out
