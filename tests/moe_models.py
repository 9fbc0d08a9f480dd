"""A user's own mixture of experts with its experts in a list of per-expert modules
(``experts.5.w1.weight``), as Megatron's ``SequentialMLP`` and transformers 4's Mixtral hold
them: a tiny decoder for ``expert_parallel`` on lists (tests/test_expert_list.py).

``moe_gpt`` calls its ``ExpertList`` once (the contract); ``loop_moe_gpt`` loops over a plain
``nn.ModuleList`` in the block (transformers 4's Mixtral), which ``expert_parallel`` refuses.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from toy_models import CausalSelfAttention

from tpplan.models.expert_list import ExpertList


class SwiGLU(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)
        self.w3 = nn.Linear(d, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """Router on the block's own tokens, top-k renormalised, one call to the experts."""

    def __init__(self, d: int, hidden: int, num_experts: int, top_k: int, loop: bool = False):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(d, num_experts, bias=False)
        self.experts = (nn.ModuleList if loop else ExpertList)(
            SwiGLU(d, hidden) for _ in range(num_experts))

    def route(self, x: torch.Tensor):
        h = x.reshape(-1, x.shape[-1])  # [T, H]
        weights, ids = self.gate(h).softmax(-1).topk(self.top_k, dim=-1)
        return h, ids, weights / weights.sum(-1, keepdim=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, ids, weights = self.route(x)
        return self.experts(h, ids, weights).view_as(x)


class LoopMoE(MoE):
    """transformers 4's Mixtral block: the block calls each expert itself."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, ids, weights = self.route(x)
        out = torch.zeros_like(h)
        for e in range(len(self.experts)):
            token, slot = torch.where(ids == e)
            out = out.index_add(0, token, self.experts[e](h[token]) * weights[token, slot, None])
        return out.view_as(x)


class Block(nn.Module):
    def __init__(self, d: int, n_head: int, moe: MoE):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, n_head)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class MoEGPT(nn.Module):
    def __init__(self, vocab_size: int = 128, d: int = 32, n_head: int = 4, n_layer: int = 2,
                 num_experts: int = 4, top_k: int = 2, hidden: int = 48, loop: bool = False):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, d)
        self.layers = nn.ModuleList(
            Block(d, n_head, (LoopMoE if loop else MoE)(d, hidden, num_experts, top_k, loop))
            for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = idx if self.wte is None else self.wte(idx)  # None: a pipeline stage's missing part
        for block in self.layers:
            x = block(x)
        if self.ln_f is not None:
            x = self.ln_f(x)
        return x if self.lm_head is None else self.lm_head(x)


def moe_gpt(**kwargs) -> MoEGPT:
    return MoEGPT(**kwargs)


def loop_moe_gpt(**kwargs) -> MoEGPT:
    return MoEGPT(loop=True, **kwargs)


def mixed_moe_gpt(**kwargs) -> MoEGPT:
    """One expert wider than the others: not a list ``expert_parallel`` can split."""
    model = MoEGPT(**kwargs)
    d = model.wte.embedding_dim
    model.layers[0].mlp.experts[1] = SwiGLU(d, 2 * d)
    return model
