"""A user model that is not the Llama: GPT-2 style, for "bring your own model" tests.

It differs from the reference Llama where plans tend to break: LayerNorm with a bias,
biased projections, learned positional embeddings, GELU, and a head count stored on the
attention module and used in ``forward`` (so ``divide_by_tp`` must make it per-rank).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (proj(x).view(B, T, self.n_head, -1).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d)
        self.c_proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, n_head)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = MLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class MiniGPT(nn.Module):
    def __init__(self, vocab_size: int = 256, d: int = 64, n_head: int = 4, n_layer: int = 2,
                 max_seq_len: int = 64):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, d)
        self.wpe = nn.Embedding(max_seq_len, d)
        self.blocks = nn.ModuleList(Block(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def mini_gpt(**kwargs) -> MiniGPT:
    return MiniGPT(**kwargs)


def float_mlp(width: int = 8) -> nn.Sequential:
    """A model that takes features, not token ids: valid to parallelize, not to trace with a
    batch of tokens."""
    return nn.Sequential(nn.Linear(width, 2 * width), nn.Linear(2 * width, width))


class FailsOnRankOne(MiniGPT):
    """Runs on one device; on rank 1 of a process group its forward raises (a worker failing
    inside ``tpplan verify``)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_rank() == 1:
            raise RuntimeError("this model fails on rank 1")
        return super().forward(idx)


def fails_on_rank_one(**kwargs) -> FailsOnRankOne:
    return FailsOnRankOne(**kwargs)


def tied_gpt(**kwargs) -> MiniGPT:
    """MiniGPT with its output head sharing the token embedding's weight (tied embeddings)."""
    model = MiniGPT(**kwargs)
    model.lm_head.weight = model.wte.weight
    return model


def mini_gpt_double(**kwargs) -> MiniGPT:
    """The same in float64: a model whose dtype is not the float32 default."""
    return MiniGPT(**kwargs).double()
