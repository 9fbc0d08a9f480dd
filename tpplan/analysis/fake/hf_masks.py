"""Fake tensors have no values: where a model's code reads them, answer as the real run does."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.nn as nn

from ..._torch.transformers import masks_as_without_tracing

__all__ = ["as_the_real_run_decides"]


@contextlib.contextmanager
def as_the_real_run_decides(model: nn.Module) -> Iterator[None]:
    """Where a model's code reads tensor values, fake tensors have none: answer as the real
    run does. HuggingFace's mask code treats a fake tensor as a sign of tracing and then
    builds a (seq x seq) mask for every layer, which the real run skips (SDPA's
    ``is_causal``): the trainer passes token ids only, so there is no padding, no cache
    offset, and the positions are the model's own 0..s-1, never packed sequences."""
    # FSDP2 subclasses the model's class: look through its bases.
    hf = any(c.__module__.startswith("transformers.") for c in type(model).__mro__)
    if not hf:
        yield
        return
    with masks_as_without_tracing():
        yield
