"""A reference Llama-3: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Written so tensor parallelism works on it unchanged: every reshape that involves heads uses
``-1`` for the head count, so a rank holding ``n_heads / tp`` heads runs the same code. The
head counts stored on ``Attention`` are informational (plans list them in ``divide_by_tp``
so the validator checks they divide and they read per rank afterwards).

Shapes: ``bs`` batch, ``s`` sequence, ``d`` model width, ``h``/``kv`` heads, ``hd`` head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from .flex import flex_document_attention, use_flex

__all__ = ["LlamaConfig", "CONFIGS", "Transformer", "build"]


@dataclass(frozen=True)
class LlamaConfig:
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    vocab_size: int = 256
    multiple_of: int = 64  # SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    # "interleaved": RoPE rotates consecutive pairs (Meta's layout); "half": it rotates
    # dimension i with i + head_dim/2 (HuggingFace's rotate_half). The two differ only by a
    # permutation of wq/wk rows within each head; weights loaded from HF use "half".
    rope_layout: str = "interleaved"
    # Llama 3.1's long-context frequency scaling: {factor, low_freq_factor,
    # high_freq_factor, original_max_position_embeddings}; None: plain RoPE.
    rope_scaling: dict | None = None
    ffn_hidden: int | None = None  # the SwiGLU width as given (HF intermediate_size)

    def problems(self) -> list[tuple[tuple[str, ...], str]]:
        """What makes this configuration unbuildable: ``(fields at fault, reason)`` pairs,
        empty when it is fine. Checked before building, so a zero or negative size is named
        instead of surfacing as a division by zero or a negative dimension inside torch."""
        out = []
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of",
                     "max_seq_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                out.append(((name,), f"must be a positive integer, got {v!r}"))
        for name in ("norm_eps", "rope_theta", "ffn_dim_multiplier"):
            v = getattr(self, name)
            if v is None and name == "ffn_dim_multiplier":
                continue
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0 \
                    or v == float("inf"):
                out.append(((name,), f"must be a positive number, got {v!r}"))
        if self.rope_layout not in ("interleaved", "half"):
            out.append((("rope_layout",), f"must be 'interleaved' or 'half', got {self.rope_layout!r}"))
        if out:
            return out
        if self.n_heads % self.n_kv_heads:
            out.append((("n_kv_heads", "n_heads"), f"n_heads={self.n_heads} is not a multiple of "
                        f"n_kv_heads={self.n_kv_heads} (each kv head serves the same number of "
                        "query heads)"))
        if self.head_dim < 2 or self.head_dim % 2:
            out.append((("n_heads", "dim"), f"head_dim = dim // n_heads = {self.dim} // "
                        f"{self.n_heads} = {self.head_dim}, which must be even (RoPE rotates "
                        "pairs of dimensions)"))
        return out

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        # Llama's rule: 2/3 of 4d, scaled, rounded up to multiple_of.
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)


# Published shapes (Meta's Llama 3 / 3.1 / 3.2 model cards); debug is ours, for CPU tests.
CONFIGS: dict[str, LlamaConfig] = {
    "debug": LlamaConfig(),
    "1b": LlamaConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
                      multiple_of=256, ffn_dim_multiplier=1.5, rope_theta=500000.0,
                      max_seq_len=8192),
    "8b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                      multiple_of=1024, ffn_dim_multiplier=1.3, rope_theta=500000.0,
                      max_seq_len=8192),
    "70b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
                       multiple_of=4096, ffn_dim_multiplier=1.3, rope_theta=500000.0,
                       max_seq_len=8192),
    "405b": LlamaConfig(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256,
                        multiple_of=4096, ffn_dim_multiplier=1.2, rope_theta=500000.0,
                        max_seq_len=8192),
}


def _scaled(freqs: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's frequency scaling: long wavelengths divided by ``factor``, short ones
    kept, a smooth blend between (as Meta's reference code and transformers do)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / freqs
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * freqs / factor + smooth * freqs
    out = torch.where(wavelen > old_len / low, freqs / factor, freqs)
    middle = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(middle, blended, out)


def rope_table(head_dim: int, max_seq_len: int, theta: float, device=None,
               scaling: dict | None = None) -> torch.Tensor:
    """(s, hd/2, 2): cos and sin of each position times each rotary frequency."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    if scaling:
        freqs = _scaled(freqs, scaling)
    angles = torch.outer(torch.arange(max_seq_len, device=device).float(), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, rope: torch.Tensor, layout: str = "interleaved") -> torch.Tensor:
    """Rotate pairs of ``x`` (bs, s, h, hd) by the angles in ``rope`` (s, hd/2, 2), or
    (bs, s, hd/2, 2) for positions of their own: pairs of consecutive dimensions
    (``interleaved``) or dimension i with i + hd/2 (``half``)."""
    cos, sin = rope[..., None, :, 0], rope[..., None, :, 1]
    if layout == "half":
        a, b = x.float().chunk(2, dim=-1)
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1).type_as(x)
    pairs = x.float().unflatten(-1, (-1, 2))  # (bs, s, h, hd/2, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    out = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.rope_layout = cfg.rope_layout
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        bs, s, _ = x.shape
        if rope.dim() == 3:  # the whole table: a pipeline stage never sees the tokens
            rope = rope[:s]
        # -1, not n_heads: under TP each rank holds n_heads / tp of them.
        q = self.wq(x).view(bs, s, -1, self.head_dim)
        k = self.wk(x).view(bs, s, -1, self.head_dim)
        v = self.wv(x).view(bs, s, -1, self.head_dim)
        q, k = apply_rope(q, rope, self.rope_layout), apply_rope(k, rope, self.rope_layout)
        out = self.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), positions)
        return self.wo(out.transpose(1, 2).reshape(bs, s, -1))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of (bs, h, s, hd) queries on (bs, kv, s, hd) keys and values;
        kv heads are shared by h / kv query heads (the ratio survives TP). ``positions``
        (bs, s) restarting at 0 mark packed documents, which never attend to each other.
        The seam context parallelism replaces (tpplan.parallel.context.sequence)."""
        if positions is not None and use_flex(q):  # CUDA, compiled: a block mask (models.flex)
            return flex_document_attention(q, k, v, positions)
        mask = None if positions is None else document_mask(positions)
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def document_mask(positions: torch.Tensor) -> torch.Tensor | None:
    """(bs, 1, s, s) block-causal mask of packed documents (a new one wherever a position
    does not continue its predecessor's, as transformers reads position ids); None when
    every row is one document, so the causal kernel runs unmasked."""
    starts = positions[:, 1:] != positions[:, :-1] + 1
    if not bool(starts.any()):
        return None
    docs = torch.cat([torch.zeros_like(positions[:, :1]), starts.long()], dim=1).cumsum(1)
    s = positions.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=positions.device).tril()
    return (causal & (docs[:, :, None] == docs[:, None, :]))[:, None]


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)  # gate
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)  # down
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig, feed_forward: nn.Module | None = None):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        # None: the dense SwiGLU; the built-in MoE (tpplan.models.moe) puts its MoE here
        self.feed_forward = FeedForward(cfg) if feed_forward is None else feed_forward

    def forward(self, x: torch.Tensor, rope: torch.Tensor,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        # positions by keyword: a plan's prepare_input on attention lists (x, rope) only
        extra = {} if positions is None else {"positions": positions}
        h = x + self.attention(self.attention_norm(x), rope, **extra)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Tokens (bs, s) -> logits (bs, s, vocab)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(self.block(cfg, i) for i in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # Not persistent: derived from the config, rebuilt by init_buffers after to_empty().
        self.register_buffer("rope", rope_table(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta,
                                                scaling=cfg.rope_scaling), persistent=False)

    def block(self, cfg: LlamaConfig, index: int) -> TransformerBlock:
        """Block ``index`` of the stack (one class for all: a subclass varies what is inside)."""
        return TransformerBlock(cfg)

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        cfg = self.config
        self.rope = rope_table(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, device=device,
                               scaling=cfg.rope_scaling)

    def init_std(self, name: str) -> float | None:
        """Initial std of parameter ``name`` (None: a norm weight, initialized to ones).

        Small-init as in GPT-2 / torchtitan: projections that write into the residual stream
        (wo, w2) are scaled down with depth, the head by width.
        """
        if name.endswith("norm.weight"):
            return None
        if name.startswith("output."):
            return self.config.dim ** -0.5
        if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
            return 0.02 / math.sqrt(2 * self.config.n_layers)
        return 0.02

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``positions`` (bs, s): each token's rotary position, restarting at 0 where a
        packed document starts (documents are then masked from each other), or its place
        in the whole sequence under context parallelism; None: 0..s-1."""
        # As a pipeline stage (docs/pipeline.md) the parts this stage does not own are None:
        # a later stage takes the previous stage's activations instead of tokens, and
        # every stage but the last returns them.
        h = tokens if self.tok_embeddings is None else self.tok_embeddings(tokens)
        rope = self.rope if positions is None else self.rope[positions]  # (bs, s, hd/2, 2)
        extra = {} if positions is None else {"positions": positions}
        for layer in self.layers:
            h = layer(h, rope, **extra)
        if self.norm is not None:
            h = self.norm(h)
        return h if self.output is None else self.output(h)


def build(config: str = "debug", **overrides) -> Transformer:
    """The reference Llama at a named size, fields overridable (``n_layers=2``)."""
    if config not in CONFIGS:
        raise KeyError(config)
    return Transformer(replace(CONFIGS[config], **overrides))
