"""A LoRA run's model on one CPU process: the frozen base as the run started it (its
``model.pretrained`` weights, or the seeded random init) with the checkpoint's adapters
(and ``modules_to_save``) on top -- what ``tpplan generate`` runs for a LoRA run."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch.nn as nn

from ..checkpoint import hf_weights
from ..models import build_model, init_weights, materialize
from ..models.pretrained import expected_tensors, hf_name_map, pretrained_dir
from ..parallel.lora.adapters import apply_lora
from ..plan.errors import CommandError

__all__ = ["lora_model"]


def lora_model(plan, state: dict, checkpoint: Path) -> nn.Module:
    """``plan``'s model with adapters, the base loaded, then ``state`` (the checkpoint's
    trained tensors) over it."""
    spec, seed = plan.model, plan.train.seed
    model = build_model(spec, "meta", real_buffers=True)
    expected = set(expected_tensors(model))
    apply_lora(plan.lora, model, None, {}, seed)
    materialize(model, "cpu")
    init_weights(model, seed, "cpu", spec)  # the run's random base (and adapters) when not pretrained
    if spec.pretrained:
        folder = pretrained_dir(spec)
        found, problems = hf_weights.read_index(folder)
        if problems:
            raise CommandError(f"the LoRA run's base {folder}: {problems[0]}")
        aliases = {"lm_head.weight": "model.embed_tokens.weight"} \
            if "lm_head.weight" in expected and "lm_head.weight" not in found else {}
        with warnings.catch_warnings():  # DCP's "assuming a single process": yes
            warnings.filterwarnings("ignore", message=".*single process.*")
            hf_weights.load(folder, model, hf_name_map(model), expected, aliases)
    missing = set(state) - {n for n, _ in model.named_parameters()}
    if missing:
        raise CommandError(f"checkpoint {checkpoint} does not fit the plan's LoRA model: "
                           f"{', '.join(sorted(missing)[:3])} is not one of its parameters")
    model.load_state_dict(state, strict=False)
    return model.eval()
