"""A parallel step against the single-device reference: the worst relative error of the
logits, the loss and every gradient, against a tolerance."""

from __future__ import annotations

import math
from dataclasses import dataclass
import torch

__all__ = ["Comparison", "StepResult", "compare", "rel_err"]


@dataclass
class StepResult:
    """One step's outputs, on one device or gathered from the ranks of a parallel run."""
    logits: torch.Tensor  # (B, S, V), the whole global batch
    loss: float
    grads: dict[str, torch.Tensor]  # parameter name -> full gradient


@dataclass
class Comparison:
    rows: list[tuple[str, float]]  # (what, worst relative error)
    tolerance: float

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def failures(self) -> list[tuple[str, float]]:
        return [(w, e) for w, e in self.rows if not e <= self.tolerance]  # NaN fails too


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a-b| / max(|b|, floor): the floor keeps gradients that are zero in exact
    arithmetic (an attention key bias cannot change softmax) from dividing by rounding noise."""
    if a.shape != b.shape:
        return float("inf")
    scale = max(b.abs().max().item(), 1e-3)
    return _worst((a.float() - b.float()).abs().max().item() / scale)


def _worst(err: float) -> float:
    """A NaN error (a NaN on either side) as infinitely wrong, so every report that takes
    the worst of several errors (``max`` skips NaN by its place) shows it."""
    return math.inf if math.isnan(err) else err


def compare(ref: StepResult, par: StepResult, tolerance: float = 1e-4) -> Comparison:
    rows = [("logits", rel_err(par.logits, ref.logits)),
            ("loss", _worst(abs(par.loss - ref.loss) / max(abs(ref.loss), 1e-3)))]
    for name, g in ref.grads.items():
        other = par.grads.get(name)
        rows.append((f"grad {name}", float("inf") if other is None else rel_err(other, g)))
    for name in par.grads.keys() - ref.grads.keys():
        rows.append((f"grad {name} (not in the reference)", float("inf")))
    return Comparison(rows, tolerance)
