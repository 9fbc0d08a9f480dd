"""``mla_kv_a_proj``: the latent key/value projection of multi-head latent attention
(DeepSeek-V2/V3, GLM-4-MoE-Lite, LongCat-Flash), transformers' ``MlaKvAProjParallel``.

``kv_a_proj_with_mqa`` stays whole on every rank; its output is the latent ``k_pass`` (into
``kv_a_layernorm`` and the colwise ``kv_b_proj``, whose input gradient is already summed
over tp) followed by ``rope_dim`` columns of ``k_rot``, which go straight to this rank's
heads. Each rank's gradient of ``k_rot`` covers its own heads only: it is summed over tp
(one all-reduce of ``batch × seq × rope_dim`` per layer in backward), so the replicated
weight gets the whole gradient on every rank.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle

from ..._torch.collectives import funcol

__all__ = ["LatentKVParallel", "rope_dim_of", "latent_kv_heads_mismatch"]


class _SumGradOverTp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh):  # noqa: D102 - identity forward
        ctx.mesh = mesh
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102 - all-reduce backward
        return funcol.all_reduce(grad.contiguous(), "sum", (ctx.mesh, 0)), None


class LatentKVParallel(ParallelStyle):
    """The latent KV projection of MLA: parameters whole, the gradient of the last
    ``rope_dim`` output columns (the shared rotary key) summed over tp.

    Example::

        >>> parallelize_module(attn.kv_a_proj_with_mqa, tp_mesh, LatentKVParallel(rope_dim=64))
    """

    def __init__(self, *, rope_dim: int | None = None) -> None:
        super().__init__()
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.rope_dim is None:
            raise ValueError("LatentKVParallel needs rope_dim")
        rope = self.rope_dim

        def output_fn(mod, inputs, out):
            if isinstance(out, DTensor):
                out = out.full_tensor()
            latent, rot = out.split([out.shape[-1] - rope, rope], dim=-1)
            return torch.cat([latent, _SumGradOverTp.apply(rot, device_mesh)], dim=-1)

        module.register_forward_hook(output_fn)
        return module

    def __repr__(self) -> str:
        return f"LatentKVParallel(rope_dim={self.rope_dim})"


def rope_dim_of(parent: nn.Module | None) -> int | None:
    """The attention's rotary key width: ``qk_rope_head_dim`` on it or its config."""
    for owner in (parent, getattr(parent, "config", None)):
        value = getattr(owner, "qk_rope_head_dim", None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def latent_kv_heads_mismatch(model: nn.Module) -> str | None:
    """Why a latent attention of ``model`` cannot run, or None: its ``kv_b_proj`` projects keys
    and values for every head, yet the config sets fewer KV heads than heads, so transformers
    repeats the keys ``num_key_value_groups`` times more (SDPA then meets 4 heads against 8,
    on one device as on many). The config field means nothing to latent attention."""
    for path, m in model.named_modules():
        kv_b, groups = getattr(m, "kv_b_proj", None), getattr(m, "num_key_value_groups", 1)
        heads = getattr(m, "num_heads", None)
        per_head = [getattr(m, k, None) for k in ("qk_nope_head_dim", "v_head_dim")]
        if not (isinstance(kv_b, nn.Linear) and isinstance(groups, int) and groups > 1
                and isinstance(heads, int) and all(isinstance(d, int) for d in per_head)):
            continue
        if kv_b.out_features == heads * sum(per_head):
            return (f"module '{path}' ({type(m).__name__}) is latent attention whose kv_b_proj "
                    f"projects keys and values for all {heads} heads, but the model's config "
                    f"sets num_key_value_heads={heads // groups} (fewer than "
                    f"num_attention_heads={heads}), so transformers repeats the keys "
                    f"{groups} times more and attention fails on any number of devices (one "
                    f"included); set num_key_value_heads to {heads}, as the released "
                    "DeepSeek-V3 and MiniCPM3 configs do")
    return None

