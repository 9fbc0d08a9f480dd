"""A list of per-expert modules called as one: the form ``expert_parallel`` spreads
(docs/moe.md, "A list of experts").

    >>> from tpplan.models.expert_list import ExpertList
    >>> self.experts = ExpertList(SwiGLU(dim, hidden) for _ in range(num_experts))
    >>> out = self.experts(x.view(-1, dim), top_k_index, top_k_weights)  # in the MoE block

Its parameters are named as in an ``nn.ModuleList`` (``experts.5.w1.weight``), so a model
that looped over its own list (``for i in range(E): self.experts[i](...)``, transformers 4's
Mixtral) keeps its checkpoints when it switches to this and to one call.
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["ExpertList"]


def _shapes_only(t: torch.Tensor) -> bool:
    from .._torch.fake import is_fake

    return t.device.type == "meta" or is_fake(t)


class ExpertList(nn.ModuleList):
    """Experts ``self[0 .. E-1]``, each a module ``[rows, H] -> [rows, H]``, called as
    ``experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``:
    the (token, expert) pairs sorted by expert, each expert run once on its rows (as
    Megatron's ``SequentialMLP`` does), weighted by the router and summed per token.

    On shapes alone (tpplan's dry run: meta or fake tensors) the rows are taken as spread
    evenly over the experts, there being no ids to count."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        n = len(self)
        if _shapes_only(flat):
            counts = [flat.numel() // n + (e < flat.numel() % n) for e in range(n)]
        else:
            counts = torch.bincount(flat, minlength=n).tolist()
            if len(counts) > n or flat.numel() and int(flat.min()) < 0:
                raise ValueError(f"ExpertList: expert ids outside [0, {n})")
        token = order // top_k_index.shape[-1]
        rows = hidden_states[token].split(counts)
        out = torch.cat([expert(x) for expert, x in zip(self, rows)])
        weights = top_k_weights.reshape(-1)[order].to(out.dtype)
        combined = torch.zeros_like(hidden_states)
        return combined.index_add(0, token, (out * weights[:, None]).to(combined.dtype))
