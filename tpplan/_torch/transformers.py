"""transformers' internals: its model registry, its private constructors and attention
setting, its MoE kernel switch and its mask helpers.

Checked on the transformers this project's environment pins (5.x) with torch 2.11 through
2.14.1. transformers is imported lazily, only where a function is called.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator

__all__ = ["attn_implementation", "can_set_experts_implementation", "causal_lm_mapping",
           "from_config", "grouped_mm_ruled_out", "has_attn_implementation",
           "masks_as_without_tracing", "set_attn_implementation"]


def causal_lm_mapping(transformers: Any, config_class: type | None) -> type:
    """``AutoModelForCausalLM``'s class for ``config_class``:
    ``AutoModelForCausalLM._model_mapping[config_class]`` (KeyError or TypeError where it
    has none)."""
    return transformers.AutoModelForCausalLM._model_mapping[config_class]


def from_config(cls: type, config: Any, **kwargs: Any) -> Any:
    """A model of class ``cls`` from ``config``: ``PreTrainedModel._from_config``, the
    constructor ``AutoModel*.from_config`` itself calls (it takes ``attn_implementation``,
    ``dtype`` and ``experts_implementation``)."""
    return cls._from_config(config, **kwargs)


def can_set_experts_implementation(cls: type) -> bool:
    """Whether ``cls`` takes ``experts_implementation``:
    ``PreTrainedModel._can_set_experts_implementation()``."""
    return cls._can_set_experts_implementation()


def has_attn_implementation(config: Any) -> bool:
    """Whether ``config`` is a transformers configuration with an attention setting
    (``PretrainedConfig._attn_implementation``)."""
    return hasattr(config, "_attn_implementation")


def attn_implementation(config: Any) -> str | None:
    """The attention implementation ``config`` names (``config._attn_implementation``)."""
    return config._attn_implementation


def set_attn_implementation(config: Any, name: str) -> None:
    """Make every attention of models on ``config`` call the interface registered as
    ``name``: ``config._attn_implementation`` set directly, as transformers' own
    ``_check_and_adjust_attn_implementation`` does after validating (a custom name
    registered with ``AttentionInterface`` is not one it validates)."""
    config._attn_implementation = name


@contextlib.contextmanager
def grouped_mm_ruled_out() -> Iterator[None]:
    """Within the block, ``transformers.integrations.moe._can_use_grouped_mm`` answers False:
    ``grouped_mm_experts_forward`` takes its fallback operator (the same shapes and saved
    tensors as torch's grouped GEMM). Restored on exit."""
    from transformers.integrations import moe

    use = moe._can_use_grouped_mm
    moe._can_use_grouped_mm = lambda *a, **k: False
    try:
        yield
    finally:
        moe._can_use_grouped_mm = use


@contextlib.contextmanager
def masks_as_without_tracing() -> Iterator[bool]:
    """Within the block, ``transformers.masking_utils`` (where loaded and having both) takes
    fake tensors for real ones: its ``is_tracing`` asks only whether compile or jit traces
    (not whether a tensor is fake), and ``find_packed_sequence_indices`` finds no packed
    sequences. Yields whether it patched; restored on exit."""
    masking = sys.modules.get("transformers.masking_utils")
    names = ("is_tracing", "find_packed_sequence_indices")
    if masking is None or not all(hasattr(masking, n) for n in names):
        yield False
        return
    saved = {n: getattr(masking, n) for n in names}
    masking.is_tracing = lambda tensor=None: saved["is_tracing"]()  # compile/jit still count
    masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield True
    finally:
        for n, f in saved.items():
            setattr(masking, n, f)
