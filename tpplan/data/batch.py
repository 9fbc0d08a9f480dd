"""One data-parallel rank's share of a step's global batch, as the training step takes it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Batch"]


@dataclass
class Batch:
    """One data-parallel rank's share of a global batch."""

    tokens: torch.Tensor  # (local batch, seq_len + 1) int64: inputs [:, :-1], targets [:, 1:]
    mask: torch.Tensor | None  # (local batch, seq_len) bool over the targets; None: all count
    count: int  # targets the loss counts in the *global* batch (its normaliser)
    # (local batch, seq_len + 1) positions restarting at each document (from the source's
    # document starts); None: found from the separator token, or none at all
    positions: torch.Tensor | None = None

    def to(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.tokens.to(device), None if self.mask is None else self.mask.to(device)
