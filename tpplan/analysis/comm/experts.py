"""Expert parallelism in figures: per-rank expert memory and the experts' all-to-all.

From shapes and the mesh alone (no trace), so ``search`` can price an ep candidate without
applying it (:func:`ep_figures`); ``validate`` prints the same beside the traced collectives,
which equal these (tests/test_expert_parallel.py). Formulas and sources: docs/moe.md, "The
dry run".

Per experts module of ``E`` routed experts, ``k`` chosen per token, hidden size ``H``,
``e`` bytes per activation element, ``T`` tokens a rank routes per micro-batch, and
``L = E / ep`` experts per rank:

- memory: each own parameter ``[E, ...]`` is split over ep (``L`` experts each), then
  FSDP2 shards dim 0 again over ``efsdp = dp_shard / ep`` (``torch.chunk``: the first ranks
  hold ``ceil(L / efsdp)``); gradients the same; AdamW two moments of it;
- all-to-all per micro-batch: forward the counts (``E × 8`` bytes), the dispatch and the
  combine (``T·k·H·e`` each, every rank's own rows, whatever the routing); backward the two
  data all-to-alls' transposes; a checkpointed block's forward runs again in backward;
- worst case: every rank's tokens choose experts of one rank, which receives (and sends
  back) ``ep · T · min(k, L)`` rows per data all-to-all: ``ep ×`` the balanced rows when
  ``k ≤ L``;
- Llama 4's dense form (experts called with every token for every expert, pre-weighted:
  :func:`tpplan.parallel.experts.forms.dense_forward`): no counts exchange, and each data
  all-to-all sends the whole ``[E·T, H]`` input in equal splits, ``E·T·H·e`` bytes whatever
  the routing (so the worst case is the balanced one);
- the minimum (each token's hidden state to each distinct remote rank among its top-k, once;
  DeepSpeed-MoE/DeepEP's deduplicated dispatch): with the ``k`` experts uniform over the
  ``E``, a given remote rank holds none of them with probability ``C(E-L, k) / C(E, k)``, so
  ``T · H · e · (ep-1) · (1 - C(E-L, k)/C(E, k))`` bytes per data all-to-all, against
  ``T · k · H · e · (ep-1)/ep`` sent one row per (token, expert) pair.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from ...parallel.experts.forms import call_form
from ...parallel.experts.style import expert_count
from ...plan.styles import EP_STYLES

__all__ = ["ExpertsModule", "experts_modules", "expert_memory", "expert_all_to_all",
           "ep_figures", "distinct_remote_ranks", "COUNT_BYTES"]

COUNT_BYTES = 8  # the counts exchanged first: one int64 per expert
BACKWARD = 2  # data all-to-alls per experts module and micro-batch in backward


@dataclass(frozen=True)
class ExpertsModule:
    """One experts container: its path, expert count, top-k, hidden size, its own
    parameters' global shapes and bytes per element, whether they train, whether a
    ``expert_parallel`` rule spreads it, and whether it is called in the dense form (every
    token for every expert)."""

    path: str
    num_experts: int
    top_k: int
    hidden: int
    shapes: tuple[tuple[int, ...], ...]
    element_size: int
    trained: bool
    parallel: bool
    per_expert: bool = False  # a list of expert modules: ``shapes`` are one expert's, each
    # sharded by FSDP2 on its own (tpplan.parallel.experts.module_list)
    dense: bool = False


def top_k_of(model: nn.Module, path: str) -> int:
    """Experts chosen per token: the router beside the experts (``top_k``), else the
    config's ``num_experts_per_tok``, else 0 (unknown: the all-to-all figures refuse it)."""
    parent = model.get_submodule(path.rpartition(".")[0]) if "." in path else model
    for m in parent.modules():
        k = getattr(m, "top_k", None)
        if isinstance(k, int) and not isinstance(k, bool) and k > 0:
            return k
    k = getattr(getattr(model, "config", None), "num_experts_per_tok", None)
    if isinstance(k, int) and k > 0:
        return k
    return 0


def router_width(model: nn.Module, path: str, num_experts: int) -> int:
    """The hidden size a user's experts take, where nothing names it: the input width of
    the router beside them (a linear layer scoring ``num_experts`` experts), else 0."""
    parent = model.get_submodule(path.rpartition(".")[0]) if "." in path else model
    return next((x.in_features for x in parent.modules()
                 if isinstance(x, nn.Linear) and x.out_features == num_experts), 0)


def experts_modules(model: nn.Module, res) -> list[ExpertsModule]:
    """Every experts container of ``model`` (parameters ``[num_experts, ...]``), with
    whether ``res`` (a Resolution) spreads it with ``expert_parallel``."""
    from torch.distributed.tensor import DTensor

    out = []
    for path, m in model.named_modules():
        n = expert_count(m)
        if n is None:
            continue
        rule = res.rule_of.get(path)
        listed = isinstance(m, nn.ModuleList)
        params = list(next(iter(m)).parameters() if listed else m.parameters(recurse=False))
        shapes = tuple(tuple(p.shape) for p in params)  # DTensors: the global shape
        hidden = getattr(m, "hidden_dim", None) or getattr(m, "hidden_size", None) or \
            getattr(getattr(model, "config", None), "hidden_size", None) or \
            listed and next((x.in_features for x in m.modules() if isinstance(x, nn.Linear)), 0) or \
            router_width(model, path, n)
        out.append(ExpertsModule(
            path, n, top_k_of(model, path), int(hidden), shapes,
            (params[0].to_local() if isinstance(params[0], DTensor) else params[0]).element_size(),
            any(p.requires_grad for p in params),
            rule is not None and rule.style.name in EP_STYLES, per_expert=listed,
            dense=call_form(m) == "dense"))
    return out


def _local_elements(shape: tuple[int, ...], num_experts: int, ep: int, fsdp: int,
                    per_expert: bool = False) -> int:
    """A parameter ``[E, ...]``'s elements on the first rank: ``E/ep`` experts, dim 0
    chunked over the ``fsdp`` ranks (``torch.chunk``: the first chunks are the largest);
    ``per_expert``: ``shape`` is one expert's, each of the ``E/ep`` chunked on its own."""
    if per_expert:
        return num_experts // ep * -(-shape[0] // fsdp) * math.prod(shape[1:])
    rows = -(-(num_experts // ep) // fsdp) if fsdp > 1 else num_experts // ep
    return rows * math.prod(shape[1:])


def expert_memory(modules: list[ExpertsModule], dims) -> dict[str, int]:
    """Bytes per rank of the routed experts' parameters, gradients and AdamW state, and the
    experts per rank (each module spread over ep where a rule says so, FSDP-sharded over
    ``efsdp``, or over ``dp_shard × cp`` where not spread)."""
    params = grads = 0
    local = []
    for mod in modules:
        ep = dims.ep if mod.parallel else 1
        fsdp = dims.efsdp if mod.parallel else dims.dp_shard * getattr(dims, "cp", 1)
        b = sum(_local_elements(s, mod.num_experts, ep, fsdp, mod.per_expert)
                for s in mod.shapes) * mod.element_size
        params += b
        grads += b if mod.trained else 0
        local.append(mod.num_experts // ep)
    return dict(modules=len(modules), experts_per_rank=max(local, default=0),
                parameters=params, gradients=grads, optimizer=2 * grads,
                total=params + grads + 2 * grads)


def distinct_remote_ranks(num_experts: int, top_k: int, ep: int) -> float:
    """Expected remote ranks among a token's ``top_k`` experts, chosen uniformly among
    ``num_experts`` spread ``num_experts / ep`` to a rank."""
    if ep <= 1:
        return 0.0
    local = num_experts // ep
    missed = math.comb(num_experts - local, top_k) / math.comb(num_experts, top_k)
    return (ep - 1) * (1 - missed)


def expert_all_to_all(modules: list[ExpertsModule], dims, shape, e: int,
                      recomputed: set[str] = frozenset()) -> dict[str, Any]:
    """The experts' all-to-all per rank per optimizer step: ``count``, ``balanced_bytes``
    (buffers, as the traced rows count them) and ``balanced_wire_bytes``, ``worst_case_bytes``
    (the busiest rank's buffers when every token picks one rank's experts) and the minimum's
    ``minimum_wire_bytes`` (hidden states only; ``over_minimum``: the hidden states tpplan
    sends over it, the counts exchange left out of both), ``dense_modules`` (how many of the
    spread modules take the dense form). ``e``: bytes per activation element;
    ``recomputed``: paths of experts modules whose forward activation checkpointing runs
    again."""
    ep, accum = dims.ep, shape.grad_accum
    # a rank routes its micro-batch's tokens; its sequence shard when ep borrows tp's ranks
    tokens = shape.micro_batch * shape.seq_len // getattr(dims, "ep_tp", 1)
    count = balanced = wire = data_wire = worst = minimum = dense = 0
    for mod in modules:
        if not mod.parallel or ep <= 1:
            continue
        if not mod.top_k:
            raise ValueError(f"experts module '{mod.path}': no top_k beside it and no "
                             "num_experts_per_tok in the model's config: the experts chosen "
                             "per token are unknown")
        fw = 1 + (mod.path in recomputed)  # forward passes per micro-batch
        data = 2 * fw + BACKWARD  # dispatch and combine each forward, two transposes back
        row = mod.hidden * e
        # rows a rank sends per data all-to-all: one per (token, expert) pair, or in the
        # dense form every token's row for every expert (and no counts exchanged first)
        pairs = tokens * (mod.num_experts if mod.dense else mod.top_k)
        count += accum * (data + (0 if mod.dense else fw))
        counts_bytes = 0 if mod.dense else mod.num_experts * COUNT_BYTES
        balanced += accum * (fw * counts_bytes + data * pairs * row)
        wire += accum * (fw * counts_bytes + data * pairs * row) * (ep - 1) // ep
        data_wire += accum * data * pairs * row * (ep - 1) / ep
        busiest = pairs if mod.dense else ep * tokens * min(mod.top_k, mod.num_experts // ep)
        dense += mod.dense
        worst += accum * (fw * counts_bytes + data * busiest * row)
        minimum += accum * data * tokens * row * distinct_remote_ranks(
            mod.num_experts, mod.top_k, ep)
    return dict(count=count, balanced_bytes=balanced, balanced_wire_bytes=wire,
                worst_case_bytes=worst, hidden_wire_bytes=int(data_wire),
                minimum_wire_bytes=int(minimum),
                over_minimum=(data_wire / minimum) if minimum else None, dense_modules=dense)


def ep_figures(model: nn.Module, res, dims, shape, e: int,
               recomputed: set[str] = frozenset()) -> dict[str, Any]:
    """Everything above for one candidate (``search``): ``memory`` (:func:`expert_memory`)
    and ``all_to_all`` (:func:`expert_all_to_all`), from the model's shapes (built, not
    necessarily parallelized), the plan's resolution and the mesh degrees."""
    modules = experts_modules(model, res)
    return dict(memory=expert_memory(modules, dims),
                all_to_all=expert_all_to_all(modules, dims, shape, e, recomputed))
