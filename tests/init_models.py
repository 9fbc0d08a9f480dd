"""A mixture-of-experts decoder written the ordinary way, for tests/test_user_init.py: grouped
experts set in ``__init__`` (``nn.Parameter(torch.randn(E, d, h) * 0.02)``, no
``reset_parameters``) called as ``experts(x, idx, w)`` and picking each expert's rows with
``torch.where``, a hand-written RMSNorm (``nn.Parameter(torch.ones(d))``), a rotary table
computed in ``__init__`` as a buffer, beside ``nn.Linear`` / ``nn.Embedding`` layers whose
random draws come first (so replaying the constructor must advance the random stream as
the plain build does)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from toy_models import MLP  # nanoGPT's MLP (c_fc, GELU, c_proj), as the toy GPT has it


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Rotary(nn.Module):
    def __init__(self, head_dim: int, max_len: int = 64):
        super().__init__()
        inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        angles = torch.outer(torch.arange(max_len).float(), inv)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x):  # x [B, heads, S, hd]
        s = x.shape[-2]
        a, b = x[..., ::2], x[..., 1::2]
        cos, sin = self.cos[:s], self.sin[:s]
        return torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.head_dim = d // heads
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        self.rotary = Rotary(self.head_dim)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(self.rotary(q), self.rotary(k), v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class GroupedExperts(nn.Module):
    """Every expert's weights in one tensor; called with three tensors under its own names."""

    def __init__(self, num_experts: int, d: int, hidden: int):
        super().__init__()
        self.num_experts = num_experts
        self.w_in = nn.Parameter(torch.randn(num_experts, d, hidden) * 0.02)
        self.w_out = nn.Parameter(torch.randn(num_experts, hidden, d) * 0.02)

    def forward(self, x, idx, w):  # x [T, d], idx [T, k], w [T, k]
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            token, slot = torch.where(idx == e)
            h = F.silu(x[token] @ self.w_in[e]) @ self.w_out[e]
            out = out.index_add(0, token, h * w[token, slot, None])
        return out


class MoE(nn.Module):
    def __init__(self, d: int, hidden: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(d, num_experts, bias=False)
        self.experts = GroupedExperts(num_experts, d, hidden)

    def forward(self, x):
        h = x.reshape(-1, x.shape[-1])
        w, idx = torch.sigmoid(self.router(h)).topk(self.top_k, dim=-1)
        return self.experts(h, idx, w / w.sum(-1, keepdim=True)).view_as(x)


class Block(nn.Module):
    def __init__(self, d: int, heads: int, hidden: int, num_experts: int, top_k: int):
        super().__init__()
        self.attn_norm = RMSNorm(d)
        self.attn = Attention(d, heads)
        self.mlp_norm = RMSNorm(d)
        self.mlp = MoE(d, hidden, num_experts, top_k)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class MoEGPT(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 4, hidden: int = 32,
                 layers: int = 2, num_experts: int = 4, top_k: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d, heads, hidden, num_experts, top_k) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def moe_gpt(**kwargs) -> MoEGPT:
    return MoEGPT(**kwargs)


class ScaledAfter(MoEGPT):
    """A parent that writes into its experts' weights after they were built: no constructor
    of the experts' own gives these numbers, so tpplan cannot replay them."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with torch.no_grad():
            for layer in self.layers:
                layer.mlp.experts.w_out.mul_(0.5)


def scaled_after(**kwargs) -> ScaledAfter:
    return ScaledAfter(**kwargs)


class ScaledAfterData(MoEGPT):
    """The same write made through ``.data``, an alias of the weight (its own tensor object):
    caught as well."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        for layer in self.layers:
            layer.mlp.experts.w_out.data.mul_(0.5)


def scaled_after_data(**kwargs) -> ScaledAfterData:
    return ScaledAfterData(**kwargs)


def nan_norm(**kwargs) -> MoEGPT:
    """A constructor that writes a NaN into the final norm: the first loss is not finite
    before any update."""
    model = MoEGPT(**kwargs)
    model.norm.weight = nn.Parameter(torch.full(model.norm.weight.shape, float("nan")))
    return model


class LayerNorm(nn.Module):
    """nanoGPT's: LayerNorm with an optional bias (set in ``__init__``, no ``reset_parameters``)."""

    def __init__(self, d: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.head_dim = d // heads
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x):  # -1 heads, chunk(3): runs unchanged on tp's packed q, k, v slices
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in self.c_attn(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, s, -1))


class NanoBlock(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln_1 = LayerNorm(d, bias=True)
        self.attn = CausalSelfAttention(d, heads)
        self.ln_2 = LayerNorm(d, bias=True)
        self.mlp = MLP(d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's GPT, small: tied embeddings, then ``self.apply(self._init_weights)`` writing
    N(0, 0.02) into every Linear and Embedding (zeros into biases) after they were built, then
    the c_proj weights rescaled by a loop over ``named_parameters`` -- none of which their own
    ``reset_parameters`` gives."""

    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 4, layers: int = 2,
                 block_size: int = 64):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, d),
            wpe=nn.Embedding(block_size, d),
            h=nn.ModuleList([NanoBlock(d, heads) for _ in range(layers)]),
            ln_f=LayerNorm(d, bias=True),
        ))
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                self._scaled(p, 0.02 / math.sqrt(2 * layers))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def _scaled(self, p, std):
        torch.nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, tokens):
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.transformer.wte(tokens) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def nano_gpt(**kwargs) -> NanoGPT:
    return NanoGPT(**kwargs)


class NanoGPTData(NanoGPT):
    """The same, written HF-style through ``.data`` (``module.weight.data.normal_``, the c_proj
    loop's ``p.data.normal_``): the writes reach the parameters through aliases."""

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.data.zero_()

    def _scaled(self, p, std):
        p.data.normal_(mean=0.0, std=std)


def nano_gpt_data(**kwargs) -> NanoGPTData:
    return NanoGPTData(**kwargs)
