"""``model.pretrained``: which tensors a model expects from an HF checkpoint folder, by name.

HF models (and a user's own model whose names are HF's) use their own state-dict names; the
built-in Llama maps its names through :mod:`.hf_llama` and takes its configuration from the
folder's ``config.json`` (or checks the named size against it). Reading the weights is
:mod:`tpplan.checkpoint.hf_weights`; this module only says what to read into what.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable

import torch.nn as nn

from .._torch.nn import non_persistent_buffers
from ..plan.errors import PlanError, PlanErrors
from ..plan.specs import ModelSpec
from . import hf_llama, llama

__all__ = ["builtin_llama", "expected_tensors", "hf_name_map", "pretrained_dir"]


def pretrained_dir(spec: ModelSpec) -> Path:
    return spec.path(spec.pretrained)


def _read_config(spec: ModelSpec) -> dict:
    folder, loc = pretrained_dir(spec), spec.locs.get("pretrained", spec.loc)
    path = folder / "config.json"
    try:
        return json.loads(path.read_text())
    except OSError as e:
        what = "no such folder" if not folder.exists() else e.strerror
        raise PlanErrors([PlanError(f"model.pretrained: cannot read '{path}': {what}", loc)]) from None
    except ValueError as e:
        raise PlanErrors([PlanError(f"model.pretrained: '{path}' is not JSON: {e}", loc)]) from None


def builtin_llama(spec: ModelSpec) -> llama.LlamaConfig:
    """The built-in Llama's configuration for weights from ``spec.pretrained``: the folder's
    own (``config`` not given), or the named size checked field by field against it. Either
    way with HF's RoPE layout (``half``), so every tensor loads unchanged."""
    hf = _read_config(spec)
    theirs, why = hf_llama.config_from_hf(hf)
    loc = spec.locs.get("pretrained", spec.loc)
    if theirs is None:
        raise PlanErrors([PlanError(f"model.pretrained: {pretrained_dir(spec)}/config.json is not "
                                    f"a Llama the built-in llama3 can hold: {'; '.join(why)}", loc)])
    if spec.config:
        ours = dataclasses.replace(llama.CONFIGS[spec.config], **spec.kwargs)
        bad = hf_llama.config_mismatches(ours, theirs)
        if bad:
            raise PlanErrors([PlanError(
                f"model.config '{spec.config}' does not match {pretrained_dir(spec)}/config.json "
                f"({'; '.join(bad)}, ours vs the checkpoint's); drop 'config' to take the "
                f"checkpoint's", spec.locs.get("config", loc))])
        return dataclasses.replace(ours, rope_layout="half", rope_scaling=theirs.rope_scaling,
                                   max_seq_len=theirs.max_seq_len)
    return dataclasses.replace(theirs, **spec.kwargs)


def hf_name_map(model: nn.Module) -> Callable[[str], str | None]:
    """The model's parameter name -> the name of the same tensor in an HF checkpoint."""
    if isinstance(model, llama.Transformer):
        return hf_llama.to_hf_name
    return lambda name: name


def expected_tensors(model: nn.Module) -> dict[str, tuple[str, tuple[int, ...]]]:
    """HF name -> (the model's name, global shape) of every tensor a checkpoint must hold:
    parameters (a tied one once, under its first name) and persistent buffers."""
    to_hf = hf_name_map(model)
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    persistent = {n for n, _ in model.named_buffers()} - _non_persistent(model)
    for name, t in [*model.named_parameters(), *((n, b) for n, b in model.named_buffers()
                                                 if n in persistent)]:
        hf = to_hf(name)
        if hf is not None:
            out[hf] = (name, tuple(t.shape))
    return out


def _non_persistent(model: nn.Module) -> set[str]:
    out = set()
    for path, m in model.named_modules():
        out |= {f"{path}.{b}" if path else b for b in non_persistent_buffers(m)}
    return out
