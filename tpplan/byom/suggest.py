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
from ..models.dataflow import Trace, trace_forward
from ..models.introspect import find_blocks, first_block, is_norm, small_hf_fields
from .ep_rules import ep_proposal
from .gated_norm import gated_norm_sp_rules, is_gated_norm
from .head_rules import merge_local_params
from .tp_fit import fit_to_tp
from .seq_rules import input_layouts, sequence_inputs, sp_norm, whole_sequence_modules
from .sublayers import sub_layer_rules, sub_layers
from ..parallel.tp.checks import composite_children
from ..parallel.tp.latent import latent_kv_heads_mismatch
from ..plan.errors import PlanError, PlanErrors
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
    like_blocks: str = "*"  # the blocks the rules cover ("0", "{0,2}") where later ones differ
    notes: list[str] = field(default_factory=list)  # what could not be decided, and why


@dataclass
class _Ends:
    """The model's calls outside its blocks, among them the output head (the last Linear) and
    the vocabulary embedding (rows = the head's outputs), if found."""
    outside: list
    head: Any
    embed: Any
    whole: Any  # the embedding's children with parameters of their own (it stays replicated), or False
    tied: bool  # the head shares its weight with the embedding


def _ends(s: Suggestion, trace: Trace, blocks: str) -> _Ends:
    """Find the embedding and the head, with a note on each one left replicated or missing."""
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
    whole = embed is not None and composite_children(embed.module)
    if whole:
        s.notes.append(f"left '{embed.path}' ({type(embed.module).__name__}) replicated: it holds "
                       f"modules with parameters of their own ({', '.join(whole)}), which "
                       "PyTorch's rowwise embedding sharding does not handle")
    tied = head is not None and embed is not None and head.module.weight is embed.module.weight
    if tied:
        s.notes.append(f"'{head.path}' shares its weight with '{embed.path}' (tied embeddings): "
                       "both split the vocabulary (dimension 0), the weight stays one weight, "
                       "and one FSDP unit holds both")
    return _Ends(outside, head, embed, whole, tied)


def _sequence_parallelism(s: Suggestion, model: nn.Module, trace: Trace, blocks: str, first: str,
                          block_call: Any, embed: Any, whole: Any, sequence_parallel: str) -> tuple[bool, bool]:
    """Decide sequence parallelism (``s.sequence_parallel``, with a note where ``auto`` is
    not safe) and, under ``blocks``, add the rule that shards each block's sequence. Returns
    whether it runs end to end and whether it runs inside the blocks."""
    # Sequence parallel is safe only if the embedding output feeds the first block alone.
    hidden0 = embed.outputs[0] if embed and embed.outputs else None
    users = [c for c in trace.consumers(hidden0) if not c.path.startswith(first + ".")] \
        if hidden0 is not None else []
    s.sequence_parallel = sequence_parallel == "auto" and bool(block_call) and not whole and \
        hidden0 is not None and [c.path for c in users] == [first]
    if sequence_parallel == "auto" and hidden0 is not None and not s.sequence_parallel:
        others = ", ".join(sorted({c.path for c in users if c.path != first}))
        others = others or "code outside any module (it is combined with something before the first block)"
        s.notes.append(f"no sequence parallelism: the embedding output is also read by {others}, "
                       "which would see only a sequence shard")
    sp = s.sequence_parallel  # end to end: the residual stream is sequence-sharded
    inner = sp or sequence_parallel == "blocks"  # sequence-sharded inside the blocks
    own = [n for n, p in model.get_submodule(first).named_parameters(recurse=False)]
    if own and sequence_parallel == "auto" and sp:  # Doge's input_residual scales the
        s.notes.append(f"no sequence parallelism: block '{first}' uses parameters of its own "
                       f"({', '.join(own)}) on the residual stream")  # residual stream
        sp = inner = s.sequence_parallel = False
    if inner and own:
        raise PlanErrors([PlanError(
            f"sequence parallelism: block '{first}' ({type(model.get_submodule(first)).__name__})"
            f" uses parameters of its own ({', '.join(own)}) on the residual stream, which "
            "holds a sequence shard under sequence parallelism: their gradients would be "
            "partial sums; tpplan does not support it (plan without sequence parallelism)")])
    if sequence_parallel == "blocks" and block_call is not None:
        hidden = block_call.args[0] if block_call.args and block_call.args[0] is not None else \
            next(iter(block_call.kwargs.values()))
        _sequence_on_dim_1(model, block_call, hidden, embed)
        rest = [None] * (block_call.arity - 1)  # DSA blocks also hand on their top-k indices
        opts = {"style": "prepare_input_output",
                **input_layouts(block_call, sequence_inputs(trace, block_call, hidden),
                                "replicate", "shard(1)"),
                "use_local_input": True,
                "output_layouts": ["shard(1)", *rest] if rest else "shard(1)",
                "desired_output_layouts": ["replicate", *rest] if rest else "replicate"}
        s.rules.append((f"{blocks}.*", opts, "sequence parallel inside each block; its output "
                        "is gathered back for the code between blocks"))
        s.sequence_parallel = True
    return sp, inner


def analyse(model: nn.Module, trace: Trace, blocks: str, sequence_parallel: str = "auto"
            ) -> Suggestion:
    """``sequence_parallel``: ``auto`` (end to end where safe), ``blocks`` (inside each block
    only: the block gathers its output back, for models that read the sequence length outside
    the blocks), or ``off``."""
    s = Suggestion(blocks=blocks)
    first = first_block(model, blocks)
    block_call = trace.first_call(first)
    ends = _ends(s, trace, blocks)
    outside, head, embed, whole, tied = ends.outside, ends.head, ends.embed, ends.whole, ends.tied
    sp, inner = _sequence_parallelism(s, model, trace, blocks, first, block_call, embed, whole,
                                      sequence_parallel)

    if embed and not whole:
        opts = {"style": "rowwise", "input_layouts": "replicate"}
        if sp:
            opts["output_layouts"] = "shard(1)"
        s.rules.append((embed.path, opts, "vocabulary rows split over tp"))

    for norm, linears, inner_norms in sub_layers(trace, first):
        if inner and norm is not None:
            s.rules += gated_norm_sp_rules(trace, norm, first) if is_gated_norm(norm.module) \
                else [sp_norm(trace, norm, first)]
        s.rules += sub_layer_rules(s, model, trace, first, block_call, norm, linears,
                                   inner_norms, inner)
    if inner:
        s.rules += whole_sequence_modules(s, trace, first, s.rules)

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

    if embed and not tied:
        s.units.append(embed.path)
    s.units.append(f"{blocks}.*")
    tail = ([embed.path] if tied else []) + [c.path for c in final_norms] + \
        ([head.path] if head else [])
    if tail:
        s.units.append(tail if len(tail) > 1 else tail[0])
    seen: set[str] = set()
    s.rules = [r for r in merge_local_params(s.rules)
               if not (r[0] in seen or seen.add(r[0]))]  # first rule wins
    return _restrict_to_like_blocks(s, model, blocks, first)


def _sequence_on_dim_1(model: nn.Module, block: Any, hidden: int, embed: Any) -> None:
    """Sequence parallelism shards dimension 1 of the hidden states; a block that takes them
    in another layout (Gemma 3n's AltUp stacks its predictions first: (inputs, batch,
    sequence, hidden)) is refused, naming it."""
    tokens = embed.shapes.get(embed.inputs[0], ()) if embed is not None and embed.inputs else ()
    shape = block.shapes.get(hidden, ())
    if len(tokens) == 2 and len(shape) >= 2 and tuple(shape[:2]) != tuple(tokens):
        kind = type(model.get_submodule(block.path)).__name__
        raise PlanErrors([PlanError(
            f"sequence parallelism: block '{block.path}' ({kind}) takes its hidden states shaped "
            f"{tuple(shape)} for tokens {tuple(tokens)}: the sequence is not dimension 1 (several "
            "residual streams stacked first, as AltUp's), which tpplan's sequence sharding "
            "needs; plan without sequence parallelism")])


def _signature(block: nn.Module) -> tuple:
    return tuple((rel, type(m).__name__) for rel, m in block.named_modules())


def _restrict_to_like_blocks(s: Suggestion, model: nn.Module, blocks: str, first: str
                             ) -> Suggestion:
    """The rules come from the first block; where later blocks differ (DeepSeek's and GLM-4
    MoE's dense first layers, then MoE layers), they apply only to the blocks like it
    (``layers.{0,1}``), and the others run replicated, whole, on every rank."""
    container = model.get_submodule(blocks)
    sig = _signature(model.get_submodule(first))
    names = [n for n, b in container.named_children()]
    like = [n for n, b in container.named_children() if _signature(b) == sig]
    if len(like) == len(names):
        return s
    alts = like[0] if len(like) == 1 else "{" + ",".join(like) + "}"
    star = f"{blocks}.*"

    def restrict(p: str) -> str:
        return alts.join([f"{blocks}.", p[len(star):]]) if p == star or \
            p.startswith(star + ".") else p

    s.rules = [(restrict(p), st, c) for p, st, c in s.rules]
    s.like_blocks = alts
    s.divide_by_tp = [restrict(p) for p in s.divide_by_tp]
    others = ", ".join(n for n in names if n not in like)
    s.notes.append(f"blocks {others} of '{blocks}' differ from block {like[0]} (other modules): "
                   "the rules cover the blocks like it; the others run replicated on every rank")
    return s


def _untraceable(e: Exception):
    reason = f"{type(e).__name__}: {e}".splitlines()[0]
    raise PlanErrors([PlanError(f"the model's forward could not be traced (one batch of "
                                f"tokens through it raised {reason})")]) from None


def suggest_plan(spec: ModelSpec, sequence_parallel: str = "auto", tp: int | None = None
                 ) -> Suggestion:
    """Trace the plan's model and infer its rules (for ``tp``, KV heads fewer than tp get
    ``kv_colwise``)."""
    model = meta = build_model(spec, "meta")
    latent = latent_kv_heads_mismatch(model)  # the trace would fail inside SDPA
    if latent:
        raise PlanErrors([PlanError(latent)])
    blocks = find_blocks(model)
    if blocks is None:
        s = Suggestion()
        s.notes.append("found no repeated blocks (a ModuleList of same-typed modules)")
        return s
    tokens = torch.randint(0, 2, (2, 16), device="meta")
    try:
        trace = trace_forward(model, tokens)
    except Exception as e:  # noqa: BLE001 - HF models: retried on a tiny CPU copy below
        if not spec.is_hf:
            raise
        if not isinstance(e, (RuntimeError, NotImplementedError)):
            _untraceable(e)
        # HF mask code reads tensor values; trace a toy-width CPU copy of the architecture
        # (the dataflow does not depend on widths).
        from ..models.hf import build_hf, hf_config

        config = hf_config(spec)
        blocks_of = getattr(config, "num_layers", None) or getattr(config, "num_hidden_layers", 2)
        layers = min(2, blocks_of) if isinstance(blocks_of, int) else 2  # no block the model lacks
        small = config.__class__(**{**config.to_dict(), **small_hf_fields(config, 2, layers)})
        with torch.device("cpu"):
            model = build_hf(spec, small)
        try:
            trace = trace_forward(model, torch.randint(0, small.vocab_size, (2, 16)))
        except Exception as e:  # noqa: BLE001 - one line, not transformers' traceback
            _untraceable(e)
    blocks = find_blocks(meta, {c.path for c in trace.calls}) or blocks
    s = analyse(model, trace, blocks, sequence_parallel)
    proposal = ep_proposal(meta)
    if proposal:
        s.notes.append(proposal)
    return fit_to_tp(s, meta, tp) if tp else s
