"""A user's mixture-of-experts GPT written the ordinary way (issue 44): grouped expert
weights set in ``__init__`` (``nn.Parameter(torch.randn(E, d, h) * 0.02)``), a sigmoid top-3
router, a shared MLP beside the experts, and an experts forward that picks each expert's rows
with ``torch.where`` (a data-dependent ``nonzero``) in a loop over the experts it holds."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from moe_models import Block  # pre-norm attention then the MoE, as the other test MoEs


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts held as three [E, ...] tensors; called as
    ``experts(x, idx, w)``: tokens [T, d], chosen experts [T, k], their weights [T, k]."""

    def __init__(self, d: int, hidden: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.randn(num_experts, d, hidden) * 0.02)
        self.w3 = nn.Parameter(torch.randn(num_experts, d, hidden) * 0.02)
        self.w2 = nn.Parameter(torch.randn(num_experts, hidden, d) * 0.02)

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(self.w1.shape[0]):  # the experts this rank holds
            rows, slot = torch.where(idx == e)
            h = x[rows]
            y = (F.silu(h @ self.w1[e]) * (h @ self.w3[e])) @ self.w2[e]
            out = out.index_add(0, rows, y * w[rows, slot, None])
        return out


class SharedMLP(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class SigmoidMoE(nn.Module):
    """Sigmoid scores, top-k of them renormalised, the experts plus a shared MLP."""

    def __init__(self, d: int, hidden: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(d, num_experts, bias=False)
        self.experts = GroupedExperts(d, hidden, num_experts)
        self.shared = SharedMLP(d, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])
        w, idx = torch.sigmoid(self.router(h)).topk(self.top_k, dim=-1)
        routed = self.experts(h, idx, w / w.sum(-1, keepdim=True))
        return (routed + self.shared(h)).view_as(x)


class UserMoEGPT(nn.Module):
    def __init__(self, vocab_size: int = 128, d: int = 32, n_head: int = 4, n_layer: int = 2,
                 num_experts: int = 8, top_k: int = 3, hidden: int = 48):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, d)
        self.layers = nn.ModuleList(
            Block(d, n_head, SigmoidMoE(d, hidden, num_experts, top_k)) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for block in self.layers:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def user_moe_gpt(**kwargs) -> UserMoEGPT:
    return UserMoEGPT(**kwargs)
