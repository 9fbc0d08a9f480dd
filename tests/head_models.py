"""A tiny language model whose attention uses parameters of its own, one entry per head:
sinks over the query heads (GPT-OSS, Granite-SWA), a bias over the KV heads (fewer than
tp, so ``kv_colwise``), and whose feed-forward holds routed experts as 3-D parameters with a
zero-compute identity expert beside them (LongCat-Flash). The attention derives its head
counts from the tensors' shapes, as TP needs."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class SinkAttention(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.q_proj = nn.Linear(d, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, d, bias=False)
        self.sinks = nn.Parameter(torch.randn(heads))
        self.kv_bias = nn.Parameter(torch.randn(kv_heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, -1, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        k = k * self.kv_bias.view(1, -1, 1, 1)  # per KV head
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        scores = q @ k.transpose(-1, -2) / self.head_dim ** 0.5
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(causal, float("-inf"))
        sink = self.sinks.view(1, -1, 1, 1).expand(B, -1, T, 1)  # per query head
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        return self.o_proj((probs @ v).transpose(1, 2).reshape(B, T, -1))


class Experts(nn.Module):
    """Every token through every expert with fixed weights, plus the identity expert."""

    def __init__(self, d: int, experts: int, inter: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * inter, d) * d ** -0.5)
        self.down_proj = nn.Parameter(torch.randn(experts, d, inter) * inter ** -0.5)
        self.identity_expert = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = 0.5 * self.identity_expert(x)
        for e in range(self.down_proj.shape[0]):
            gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
            out = out + F.linear(F.silu(gate) * up, self.down_proj[e]) / (e + 1)
        return out


class Block(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int):
        super().__init__()
        self.norm1 = nn.RMSNorm(d)
        self.attn = SinkAttention(d, heads, kv_heads, d // heads)
        self.norm2 = nn.RMSNorm(d)
        self.moe = Experts(d, 2, 2 * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.moe(self.norm2(x))


class SinkLM(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 4, kv_heads: int = 1,
                 layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads, kv_heads) for _ in range(layers))
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def sink_lm(**kwargs) -> SinkLM:
    return SinkLM(**kwargs)
