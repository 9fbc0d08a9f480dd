"""The style vocabulary: names, options and layouts, as data (no torch needed to read them).

Each style is the PyTorch one under a stable short name, with PyTorch's keyword names:

- ``colwise`` (ColwiseParallel): input_layouts, output_layouts, use_local_output, uneven
- ``rowwise`` (RowwiseParallel): input_layouts, output_layouts, use_local_output, uneven

``uneven: true`` (tpplan's) allows a sharded dimension tp does not divide: the first ranks
hold ``ceil(n/tp)`` rows, the last ones fewer; the parameter keeps its real shape.
- ``sequence_parallel`` (SequenceParallel): sequence_dim, use_local_output
- ``prepare_input`` (PrepareModuleInput): input_layouts, desired_input_layouts,
  input_kwarg_layouts, desired_input_kwarg_layouts, use_local_output
- ``prepare_output`` (PrepareModuleOutput): output_layouts, desired_output_layouts,
  use_local_output
- ``prepare_input_output`` (PrepareModuleInputOutput): both of the above, and use_local_input;
  tpplan's ``flat_tokens: true`` reshards outputs shaped ``(batch × sequence, ...)`` (Llama
  4's MoE flattens its tokens) as ``(batch, sequence, ...)`` (tpplan.parallel.tp.prepare_io)
- ``replicate`` (tpplan's ReplicateParallel): parameters replicated on tp; no options
- ``kv_colwise`` (tpplan's KVColwiseParallel): head_dim (default: the parent module's
  ``head_dim`` attribute, as transformers' attentions store it), input_layouts; a key or
  value projection with fewer heads than tp: the weight stays whole (replicated on tp), each
  rank computes the KV head its query heads use, gradients summed over tp
- ``mla_kv_a_proj`` (tpplan's LatentKVParallel, transformers' name): multi-head latent
  attention's ``kv_a_proj_with_mqa``, whole on every rank; the gradient of its last
  ``rope_dim`` output columns (the rotary key shared by all heads; default: the attention's
  ``qk_rope_head_dim``) is summed over tp, since each rank's heads read it

- ``local_params`` (tpplan's HeadParamsParallel, transformers' name): head_params; a module
  whose own parameters hold one entry per head (attention sinks, Beam's ``gate_bias``): each
  named parameter (dimension 0 over the heads) is split as the heads of the colwise
  projections beside it, and the module's forward sees this rank's entries as a plain tensor.
  ``head_params`` is also an option of the ``prepare_*`` styles, for a module that has one

HuggingFace ``tp_plan`` strings with an exact equivalent are accepted as style names:
``colwise_rep`` (or ``colwise_gather_output``) is colwise with ``output_layouts: replicate``,
``rowwise_rep`` (or ``rowwise_split_input``) is rowwise with ``input_layouts: replicate``.

tpplan's own styles for weights PyTorch's styles cannot split (tpplan.parallel.tp.packed):

- ``packed_colwise``: a linear layer whose output packs several parts (Phi-3's
  ``qkv_proj``, ``gate_up_proj``), each part split over tp, so every rank gets its slice of
  every part; its output stays a local tensor ``[part0_t, part1_t, ...]``. Options:
  ``parts`` (a count of equal parts, or the parts' relative sizes: integers or names of
  integer attributes of the layer's parent or its ``config``; named attributes become
  per-rank on that parent), ``input_layouts``. transformers' ``colwise_packed`` is an alias.
- ``experts_colwise_rowwise``: a mixture-of-experts module holding its routed experts as
  3-D parameters (``gate_up_proj`` [experts, 2 x inter, hidden], ``down_proj`` [experts,
  hidden, inter]): each expert's intermediate dimension split over tp (gate and up halves
  separately), the output summed over tp. No options; transformers' ``moe_tp_experts``.

Expert parallelism (tpplan.parallel.experts.style; docs/moe.md):

- ``expert_parallel``: a mixture-of-experts module holding its routed experts as parameters
  ``[num_experts, ...]`` and called as ``experts(hidden_states, top_k_index,
  top_k_weights)`` (transformers 5's experts classes), or a list of per-expert modules
  called so (``tpplan.models.expert_list.ExpertList``): each of ``mesh.ep`` ranks keeps
  ``num_experts / ep`` experts; tokens go to the rank owning each of their experts with an
  all-to-all and come back with another. No options. Not a tensor-parallel style: it is
  applied on the ``ep`` ranks, and whole on every tp rank.
- ``sequence_local`` (tpplan's SequenceLocal; tpplan.parallel.experts.sequence_local): a module (an
  MoE block) that runs on this rank's sequence shard as plain tensors: no gather before it,
  nothing after it (its output is the residual stream's shard). Every parameter below it,
  but those of an ``expert_parallel`` module inside, is replicated on tp and its gradient
  summed over tp (each rank's tokens differ). With ``expert_parallel`` inside, ``mesh.ep``
  borrows tp's ranks too (docs/moe.md, "The mesh rule"). Option: ``sequence_dim`` (default 1).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Layout", "NAMES", "STYLES", "ALIASES", "SHARDING_STYLES", "PACKED_STYLES", "EP_STYLES",
           "SEQUENCE_LOCAL", "ep_borrows_tp", "TPPLAN_OPTIONS", "parse_layout", "StyleSpec"]


@dataclass(frozen=True)
class Layout:
    """A placement on the tp dimension: ``shard(dim)``, ``replicate`` or ``partial``."""

    kind: str  # "shard" | "replicate" | "partial"
    dim: int | None = None

    def __str__(self) -> str:
        return f"shard({self.dim})" if self.kind == "shard" else self.kind

    def to_torch(self):
        from torch.distributed.tensor import Partial, Replicate, Shard

        if self.kind == "shard":
            return Shard(self.dim)
        return Replicate() if self.kind == "replicate" else Partial()


_SHARD = re.compile(r"^\s*shard\s*\(\s*(-?\d+)\s*\)\s*$", re.IGNORECASE)
LAYOUT_WORDS = ["shard(0)", "shard(1)", "shard(-1)", "replicate", "partial", "null"]


def parse_layout(value: Any) -> Layout | None:
    """``shard(d)``, ``replicate``, ``partial`` or ``null`` (None). Raises ValueError."""
    if value is None:
        return None
    if isinstance(value, str):
        m = _SHARD.match(value)
        if m:
            return Layout("shard", int(m.group(1)))
        word = value.strip().lower().removesuffix("()")
        if word in ("replicate", "partial"):
            return Layout(word)
        if word in ("null", "none", "~"):
            return None
    raise ValueError(f"'{value}' is not a layout; expected shard(d), replicate, partial or null")


# kinds of option values
LAYOUT = "layout"  # one layout
LAYOUTS = "layouts"  # one layout or a list of layouts (one per positional input/output)
KWARG_LAYOUTS = "kwarg_layouts"  # {name: layout}
BOOL = "bool"
INT = "int"
PARTS = "parts"  # a count, or a list of integers and attribute names
NAMES = "names"  # a name or a list of names (parameters of the module)

_INPUT = {
    "head_params": NAMES,
    "input_layouts": LAYOUTS,
    "desired_input_layouts": LAYOUTS,
    "input_kwarg_layouts": KWARG_LAYOUTS,
    "desired_input_kwarg_layouts": KWARG_LAYOUTS,
}
_OUTPUT = {"output_layouts": LAYOUTS, "desired_output_layouts": LAYOUTS}

STYLES: dict[str, dict[str, str]] = {
    "colwise": {"input_layouts": LAYOUT, "output_layouts": LAYOUT, "use_local_output": BOOL,
                "uneven": BOOL},
    "rowwise": {"input_layouts": LAYOUT, "output_layouts": LAYOUT, "use_local_output": BOOL,
                "uneven": BOOL},
    "sequence_parallel": {"sequence_dim": INT, "use_local_output": BOOL},
    "prepare_input": {**_INPUT, "use_local_output": BOOL},
    "prepare_output": {**_OUTPUT, "use_local_output": BOOL, "head_params": NAMES},
    "prepare_input_output": {**_INPUT, "use_local_input": BOOL, **_OUTPUT, "use_local_output": BOOL,
                             "flat_tokens": BOOL},
    "replicate": {},
    "packed_colwise": {"parts": PARTS, "input_layouts": LAYOUT},
    "experts_colwise_rowwise": {},
    "kv_colwise": {"head_dim": INT, "input_layouts": LAYOUT},
    "mla_kv_a_proj": {"rope_dim": INT},
    "local_params": {"head_params": NAMES},
    "expert_parallel": {},
    "sequence_local": {"sequence_dim": INT},
}

# tpplan's own options, read by resolve and never passed to the PyTorch style: ``uneven``
# lets a sharded dimension tp does not divide (GPT-2's 50,257 tokens) be split unevenly;
# ``head_params`` splits a module's own per-head parameters (tpplan.parallel.tp.head_params);
# ``flat_tokens`` is read by tpplan's ``prepare_input_output`` (tpplan.parallel.tp.prepare_io)
TPPLAN_OPTIONS = ("uneven", "head_params", "flat_tokens")

# options a style cannot do without
REQUIRED = {
    "prepare_output": ("output_layouts", "desired_output_layouts"),
    "prepare_input_output": ("output_layouts", "desired_output_layouts"),
    "packed_colwise": ("parts",),
    "local_params": ("head_params",),
}

# HuggingFace tp_plan names with an exact PyTorch equivalent: name -> (style, preset options)
ALIASES: dict[str, tuple[str, dict[str, Any]]] = {
    "colwise_rep": ("colwise", {"output_layouts": Layout("replicate")}),
    "rowwise_rep": ("rowwise", {"input_layouts": Layout("replicate")}),
    # transformers' later names for the same two
    "colwise_gather_output": ("colwise", {"output_layouts": Layout("replicate")}),
    "rowwise_split_input": ("rowwise", {"input_layouts": Layout("replicate")}),
    "colwise_packed": ("packed_colwise", {}),
    "moe_tp_experts": ("experts_colwise_rowwise", {}),
}

# styles that shard parameters, and the module types PyTorch can shard with them
SHARDING_STYLES = ("colwise", "rowwise")
PACKED_STYLES = ("packed_colwise", "experts_colwise_rowwise")  # tpplan's own, parallel.packed
EP_STYLES = ("expert_parallel",)  # applied on mesh.ep, not tp (parallel.expert_parallel)
SEQUENCE_LOCAL = "sequence_local"  # a block on the sequence shard (parallel.sequence_local)


def ep_borrows_tp(rules) -> bool:
    """Whether ``mesh.ep`` borrows tp's ranks: the plan runs its MoE blocks on the sequence
    shard (a ``sequence_local`` rule beside an ``expert_parallel`` one), so tp ranks hold
    different tokens at the experts (docs/moe.md, "The mesh rule")."""
    names = {r.style.name for r in rules}
    return SEQUENCE_LOCAL in names and bool(names & set(EP_STYLES))


@dataclass
class StyleSpec:
    """A style name with its parsed options (``tpplan.parallel.tp.styles.build_style`` makes
    the PyTorch style object from it)."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        if not self.options:
            return self.name
        opts = ", ".join(f"{k}={_show(v)}" for k, v in self.options.items())
        return f"{self.name}({opts})"


def _show(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_show(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_show(x)}" for k, x in v.items()) + "}"
    return "null" if v is None else str(v)
