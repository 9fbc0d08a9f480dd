"""Model FLOPs per token, counted from the model itself, unit by unit.

Forward FLOPs per token of a unit are ``2 × (weights of its Linear layers)`` (one multiply
and one add per weight; embeddings are lookups, not matmuls) plus, in each repeated block,
attention's two matmuls ``QKᵀ`` and ``AV``: ``2 × 2 × s × d_attn`` with ``d_attn = n_heads ×
head_dim`` (counted over the whole ``s × s`` score matrix, as PaLM's appendix B and
torchtitan count it; causal kernels skip about half of it, which the compute efficiency
absorbs). Backward costs twice forward, so a training step costs ``3 ×`` forward: the
familiar ``6N + 12·L·d·s`` per token. Weights are counted from global shapes (a DTensor's
``shape`` is the whole tensor), so the same figure comes out at any tp.

A mixture of experts' routed experts (``[num_experts, ...]`` parameters, or a list of
per-expert modules) count as the experts a token runs through: ``top_k`` of them per token
(every one in Llama 4's dense form), ``2 × top_k × (one expert's weights)`` per token — the
*active* weights, as MoE MFU is reported (Mixtral: 12.9B of 46.7B). Their GEMM shapes enter
:attr:`ModelFlops.linears` once per expert a token runs through (the rows each expert sees,
``tokens × top_k / num_experts``, are fewer than the unit's tokens the efficiency is read at:
the estimate's expert GEMMs are as efficient as a dense layer's of the same shape).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn

from ..._torch.modules import own_children
from ...models.introspect import find_blocks
from ...parallel.experts.forms import call_form, expert_count

__all__ = ["ModelFlops", "model_flops"]


@dataclass(frozen=True)
class ModelFlops:
    """Forward FLOPs per token by unit (top-level modules, each block its own), in order."""

    forward: dict[str, float]  # unit path -> forward FLOPs per token
    blocks: tuple[str, ...]  # the units that are repeated blocks
    matmul_params: int  # weights of every Linear (the N of 6N)
    attention_width: int  # n_heads × head_dim (0: unknown, attention not counted)
    # unit path -> its Linear layers as (path, in_features, out_features): the GEMM shapes
    linears: dict[str, tuple[tuple[str, int, int], ...]] = field(default_factory=dict)
    attention_heads: int = 0  # n_heads (0: unknown)

    @property
    def train_per_token(self) -> float:
        """Forward + backward FLOPs per token: ``3 ×`` forward."""
        return 3 * sum(self.forward.values())

    def forward_of(self, units) -> float:
        return sum(self.forward.get(u, 0.0) for u in units)

    def rank_units(self, stages: list[dict] | None) -> list[list[str]]:
        """The units each pp rank runs, for a pipeline's stages (``pipeline.stages``: first
        and last module, pp rank); one rank with every unit without a pipeline, or when a
        stage's modules are not units of this count."""
        order = list(self.forward)
        if not stages:
            return [order]
        per_rank: dict[int, list[str]] = {}
        for s in stages:
            if s["first_module"] not in order or s["last_module"] not in order:
                return [order]
            lo, hi = order.index(s["first_module"]), order.index(s["last_module"])
            per_rank.setdefault(s["pp_rank"], []).extend(order[lo:hi + 1])
        return list(per_rank.values())


def _attention_heads(model: nn.Module) -> tuple[int, int]:
    """``(n_heads, head_dim)`` from the model's config (ours or a HuggingFace one), zeros
    if none."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return 0, 0
    heads = getattr(cfg, "n_heads", None) or getattr(cfg, "num_attention_heads", None)
    dim = getattr(cfg, "dim", None) or getattr(cfg, "hidden_size", None)
    if not heads or not dim:
        return 0, 0
    head_dim = getattr(cfg, "head_dim", None) or dim // heads
    return int(heads), int(head_dim)


def _attention_width(model: nn.Module) -> int:
    """``n_heads × head_dim`` from the model's config (ours or a HuggingFace one), 0 if none."""
    heads, head_dim = _attention_heads(model)
    return heads * head_dim


def _units(model: nn.Module, blocks: str | None) -> list[tuple[str, nn.Module, bool]]:
    """(path, module, is a block) in order: top-level modules, the blocks' container
    opened (and any module on the way to it), so each block is a unit."""
    out: list[tuple[str, nn.Module, bool]] = []

    def walk(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if blocks is not None and path == blocks:
                out.extend((f"{path}.{n}", c, True) for n, c in child.named_children())
            elif blocks is not None and blocks.startswith(path + "."):
                walk(path + ".", child)
            else:
                out.append((path, child, False))

    walk("", model)
    return out


def _experts(model: nn.Module) -> dict[str, tuple[nn.Module, int]]:
    """Each routed-experts container of ``model`` by path, with how many of its experts a
    token runs through (its router's top-k, or all of them in the dense form)."""
    from ..comm.experts import top_k_of

    out = {}
    for path, m in model.named_modules():
        n = expert_count(m)
        if n:
            out[path] = (m, n if call_form(m) == "dense" else (top_k_of(model, path) or n))
    return out


def _expert_gemms(path: str, m: nn.Module, active: int) -> list[tuple[str, int, int]]:
    """One expert's GEMMs of the container ``m`` as ``(path, in, out)``, ``active`` times."""
    if isinstance(m, nn.ModuleList):
        one = _linear_shapes(f"{path}.{next(iter(own_children(m)))}", next(iter(m)))
    else:  # [E, out, in] (gpt-oss's transposed [E, in, out] has the same product)
        one = tuple((f"{path}.{n}", int(p.shape[2]), int(p.shape[1]))
                    for n, p in m.named_parameters(recurse=False) if p.dim() == 3)
    return list(one) * active


def _linear_weights(module: nn.Module, experts: dict | None = None, prefix: str = "") -> int:
    """The weights a token multiplies in ``module`` (at ``prefix``): its Linear layers', an
    experts container's counted for the experts a token runs through (``experts``)."""
    return sum(i * o for _, i, o in _linear_shapes(prefix, module, experts or {}))


def _linear_shapes(path: str, module: nn.Module,
                   experts: dict | None = None) -> tuple[tuple[str, int, int], ...]:
    """Each Linear under ``module`` as ``(path, in_features, out_features)``, global shapes
    (a DTensor's ``shape`` is the whole tensor); an experts container (``experts``, by
    path) as :func:`_expert_gemms`."""
    out, inside = [], []
    for name, m in module.named_modules():
        full = f"{path}.{name}" if name and path else (name or path)
        if any(full.startswith(c + ".") for c in inside):
            continue
        if experts and full in experts:
            inside.append(full)
            out.extend(_expert_gemms(full, *experts[full]))
        elif isinstance(m, nn.Linear):
            o, i = m.weight.shape
            out.append((full, int(i), int(o)))
    return tuple(out)


def model_flops(model: nn.Module, seq_len: int, blocks: str | None = None) -> ModelFlops:
    """Forward FLOPs per token of each unit of ``model`` at sequence length ``seq_len``;
    ``blocks``: the path of the blocks' container when the model's own structure does not
    show it (a single block is not "repeated")."""
    blocks = find_blocks(model) or blocks
    heads, head_dim = _attention_heads(model) if blocks else (0, 0)
    width = heads * head_dim
    experts = _experts(model)
    forward: dict[str, float] = {}
    linears: dict[str, tuple[tuple[str, int, int], ...]] = {}
    block_units = []
    for path, module, is_block in _units(model, blocks):
        linears[path] = _linear_shapes(path, module, experts)
        f = 2.0 * sum(i * o for _, i, o in linears[path])
        if is_block:
            f += 4.0 * seq_len * width
            block_units.append(path)
        forward[path] = f
    return ModelFlops(forward, tuple(block_units), _linear_weights(model, experts), width,
                      linears, heads)
