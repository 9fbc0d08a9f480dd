"""The built-in mixture of experts: the reference Llama with MoE feed-forwards.

A block's ``feed_forward`` is either the Llama's dense SwiGLU or a :class:`MoE`: a router
(``TopKRouter``: softmax over the experts, the top ``k`` kept, optionally renormalized),
``num_experts`` SwiGLU experts held as grouped parameters and an optional shared expert that
every token goes through. Blocks ``i`` with ``(i + 1) % moe_every == 0`` are MoE blocks
(Llama 4's ``interleave_moe_layer_step``, Qwen-MoE's ``decoder_sparse_step``).

The experts (:class:`Experts`) are stored and called as transformers 5 stores and calls its
MoE experts -- ``gate_up_proj [E, 2 × inter, dim]`` (gate rows, then up rows),
``down_proj [E, dim, inter]``, an integer ``num_experts``, called as
``experts(hidden_states [T, dim], top_k_index [T, k], top_k_weights [T, k])`` -- so the
``expert_parallel`` style (docs/moe.md) and expert TP (``experts_colwise_rowwise``) apply
to it unchanged, as they do to Qwen3-MoE or Mixtral.

With ``router_aux_loss_coef > 0`` each MoE block adds Switch Transformer's load-balancing
term ``E · Σ_e f_e · P_e`` over the tokens of its forward (``f_e``: the fraction of tokens
that chose expert ``e``; ``P_e``: the mean router probability of ``e``), summed over the MoE
blocks; the model keeps ``coef × Σ`` for whoever computes the loss, as tpplan does for the
HuggingFace families (:mod:`tpplan.models.moe_loss`, docs/moe.md "Auxiliary loss").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import llama
from .moe_loss import keep_aux_term

__all__ = ["MoEConfig", "CONFIGS", "MoETransformer", "MoE", "TopKRouter", "Experts", "build"]


@dataclass(frozen=True)
class MoEConfig(llama.LlamaConfig):
    num_experts: int = 8
    top_k: int = 2
    moe_hidden: int = 128  # each routed expert's SwiGLU width
    moe_every: int = 1  # blocks i with (i + 1) % moe_every == 0 hold a MoE
    shared_hidden: int = 0  # the shared expert's SwiGLU width; 0: no shared expert
    norm_topk_prob: bool = True  # renormalize the k chosen probabilities to sum to 1
    router_aux_loss_coef: float = 0.0  # > 0: train on the load-balancing loss too

    @property
    def output_router_logits(self) -> bool:
        """Whether the model computes its load-balancing loss (transformers' config name:
        the checks that refuse it under pp and cp read it)."""
        return self.router_aux_loss_coef > 0

    def is_moe(self, index: int) -> bool:
        """Whether block ``index`` holds a MoE (else the dense SwiGLU)."""
        return (index + 1) % self.moe_every == 0

    def problems(self) -> list[tuple[tuple[str, ...], str]]:
        out = super().problems()
        for name in ("num_experts", "top_k", "moe_hidden", "moe_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                out.append(((name,), f"must be a positive integer, got {v!r}"))
        v = self.shared_hidden
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            out.append((("shared_hidden",), f"must be 0 (none) or a positive integer, got {v!r}"))
        v = self.router_aux_loss_coef
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v < float("inf"):
            out.append((("router_aux_loss_coef",), f"must be a number >= 0, got {v!r}"))
        if not isinstance(self.norm_topk_prob, bool):
            out.append((("norm_topk_prob",), f"must be true or false, got {self.norm_topk_prob!r}"))
        if not out and self.top_k > self.num_experts:
            out.append((("top_k", "num_experts"), f"top_k={self.top_k} chooses more experts "
                        f"than num_experts={self.num_experts}"))
        return out


# debug is ours, for CPU tests. The others take published shapes (Mixtral-8x7B's config.json;
# Llama 4 Scout 17B-16E and Maverick 17B-128E's text configs) with this model's routing:
# softmax top-k (Llama 4 scores its top-1 with a sigmoid; here its softmax probability) and
# no NoPE or chunked-attention layers; max_seq_len sizes the rotary table, not the model.
CONFIGS: dict[str, MoEConfig] = {
    "debug": MoEConfig(),
    "mixtral-8x7b": MoEConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000,
                              rope_theta=1e6, max_seq_len=32768, num_experts=8, top_k=2,
                              moe_hidden=14336),
    "llama4-scout": MoEConfig(dim=5120, n_layers=48, n_heads=40, n_kv_heads=8, vocab_size=202048,
                              rope_theta=500000.0, max_seq_len=8192, num_experts=16, top_k=1,
                              moe_hidden=8192, shared_hidden=8192, norm_topk_prob=False),
    "llama4-maverick": MoEConfig(dim=5120, n_layers=48, n_heads=40, n_kv_heads=8,
                                 vocab_size=202048, rope_theta=500000.0, max_seq_len=8192,
                                 num_experts=128, top_k=1, moe_hidden=8192, shared_hidden=8192,
                                 moe_every=2, ffn_hidden=16384, norm_topk_prob=False),
}


class TopKRouter(nn.Module):
    """(T, dim) tokens -> (probabilities (T, E) in fp32, the top-k weights (T, k), their
    expert ids (T, k))."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = cfg.num_experts, cfg.top_k, \
            cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.dim))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, hidden_states: torch.Tensor):
        probs = F.linear(hidden_states, self.weight).float().softmax(dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, weights.to(hidden_states.dtype), ids


def _shapes_only(t: torch.Tensor) -> bool:
    """Meta or fake tensors (the dry run): no expert ids to count."""
    from .._torch.fake import is_fake

    return not torch.compiler.is_compiling() and (t.device.type == "meta" or is_fake(t))


class Experts(nn.Module):
    """``num_experts`` SwiGLU experts held as grouped parameters, in transformers 5's form
    (see the module docstring). Each (token, expert) pair is one row: the rows are sorted by
    expert, each expert runs on its own, the results are weighted and summed per token. An
    id equal to ``num_experts`` means "no expert" (transformers' convention): its row adds
    nothing. On shapes alone (the dry run) the rows are split evenly, as the dry run's
    balanced routing assumes.

    The output depends on ``hidden_states`` even when no row reaches any expert (a rank
    ``expert_parallel`` sent nothing): the dispatch's all-to-all is then still in the graph,
    so its backward -- a collective -- runs on every ep rank, not on some only (a hang)."""

    def __init__(self, num_experts: int, dim: int, hidden: int):
        super().__init__()
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, dim, hidden
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden))
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        n, k = self.num_experts, top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # rows grouped by expert
        token = order // k
        rows = hidden_states[token]
        if _shapes_only(flat):
            counts = [len(flat) // n + (e < len(flat) % n) for e in range(n)]
        else:
            counts = torch.bincount(flat, minlength=n + 1).tolist()
            if len(counts) > n + 1:  # (a negative id fails in bincount)
                raise ValueError(f"the router chose an expert outside [0, {n})")
        # unbind: one stacked gradient per parameter in backward, not one per expert
        gate_up, down = self.gate_up_proj.unbind(0), self.down_proj.unbind(0)
        outs = []
        for e, x in enumerate(rows.split(counts[:n] + [len(flat) - sum(counts[:n])])):
            if e == n:  # the "no expert" rows (often none) add nothing, but stay in the graph
                outs.append(x * 0)
            elif len(x):  # an expert no row chose is left out
                gate, up = F.linear(x, gate_up[e]).chunk(2, dim=-1)
                outs.append(F.linear(F.silu(gate) * up, down[e]))
        out = torch.cat(outs) * top_k_weights.reshape(-1)[order, None].to(rows.dtype)
        return torch.zeros_like(hidden_states).index_add(0, token, out.to(hidden_states.dtype))


class MoE(nn.Module):
    """A block's feed-forward as a mixture of experts: (bs, s, dim) -> (bs, s, dim)."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.top_k = cfg.top_k  # read by the dry run's all-to-all figures
        self.router = TopKRouter(cfg)
        self.experts = Experts(cfg.num_experts, cfg.dim, cfg.moe_hidden)
        self.shared_expert = llama.FeedForward(replace(cfg, ffn_hidden=cfg.shared_hidden)) \
            if cfg.shared_hidden else None
        self.aux_loss = cfg.router_aux_loss_coef > 0
        self.aux: torch.Tensor | None = None  # this forward's load-balancing term

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (T, dim): under tp + SP, the gathered sequence
        probs, weights, ids = self.router(flat)
        out = self.experts(flat, ids, weights)
        if self.shared_expert is not None:
            out = out + self.shared_expert(flat)
        if self.aux_loss:
            self.aux = _load_balancing(probs, ids)
        return out.view(x.shape)


def _load_balancing(probs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's ``E · Σ_e f_e · P_e`` over these tokens (``f_e`` counts a token
    once per chosen expert, as transformers' ``load_balancing_loss_func``)."""
    tokens, experts = probs.shape
    chosen = torch.zeros(experts, dtype=probs.dtype, device=probs.device).index_add(
        0, ids.reshape(-1), torch.ones(ids.numel(), dtype=probs.dtype, device=probs.device))
    return experts * (chosen / tokens * probs.mean(0)).sum()


class MoETransformer(llama.Transformer):
    """Tokens (bs, s) -> logits (bs, s, vocab), MoE feed-forwards in the blocks the config
    names; the load-balancing term of the forward kept for the loss when asked for."""

    config: MoEConfig

    def block(self, cfg: MoEConfig, index: int) -> llama.TransformerBlock:
        return llama.TransformerBlock(cfg, MoE(cfg) if cfg.is_moe(index) else None)

    @property
    def router_aux_loss_coef(self) -> float:
        return self.config.router_aux_loss_coef

    def init_std(self, name: str) -> float | None:
        if name.endswith(("experts.down_proj", "shared_expert.w2.weight")):
            return 0.02 / math.sqrt(2 * self.config.n_layers)  # they write the residual
        return super().init_std(name)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        out = super().forward(tokens, positions)
        if self.config.router_aux_loss_coef > 0:
            terms = []
            for m in self.modules():  # this stage's MoE blocks (all of them off a pipeline)
                if isinstance(m, MoE) and m.aux is not None:
                    terms.append(m.aux)
                    m.aux = None
            keep_aux_term(self, sum(terms) if terms else None)
        return out


def build(config: str = "debug", **overrides) -> MoETransformer:
    """The built-in MoE at a named size, fields overridable (``num_experts=4``)."""
    if config not in CONFIGS:
        raise KeyError(config)
    return MoETransformer(replace(CONFIGS[config], **overrides))
