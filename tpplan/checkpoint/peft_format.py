"""PEFT's LoRA adapter folder: ``adapter_config.json`` + ``adapter_model.safetensors``.

The format ``peft.PeftModel.from_pretrained(base, folder)`` loads and ``save_pretrained``
writes; shared by ``tpplan export --format peft`` (out) and ``model.adapter`` (in), without
importing ``peft``. Names: tpplan's adapter ``x.q_proj.lora_A.weight`` is PEFT's
``base_model.model.x.q_proj.lora_A.weight``; a module in ``modules_to_save`` is saved under
its own parameter names (``base_model.model.model.norm.weight``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..plan.specs import LoraSpec

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "PREFIX", "adapter_config", "from_peft_name",
           "read_adapter", "to_peft_name"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."


def to_peft_name(name: str) -> str:
    return PREFIX + name


def from_peft_name(key: str) -> str:
    """PEFT's saved key -> tpplan's parameter name (an adapter's name ``.default`` dropped)."""
    name = key.removeprefix(PREFIX)
    return name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")


def adapter_config(spec: LoraSpec, targets: list[str], saved: list[str],
                   base: str | None) -> dict[str, Any]:
    """The ``adapter_config.json`` of ``spec``'s adapters on the modules ``targets`` (full
    paths: PEFT matches a listed name exactly or as a dotted suffix)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout,
        "use_rslora": spec.rslora, "init_lora_weights": True if spec.init == "kaiming" else
        spec.init, "target_modules": sorted(targets), "modules_to_save": sorted(saved) or None,
        "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "use_dora": False,
        "rank_pattern": {}, "alpha_pattern": {},
    }


def read_adapter(folder: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(the folder's adapter config, its tensors under tpplan's names); ValueError naming
    the file for a folder that is not a PEFT LoRA adapter."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config_file, weights = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    for f in (config_file, weights):
        if not f.is_file():
            raise ValueError(f"'{folder}' is not a PEFT adapter folder: {f.name} is missing")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{config_file}: cannot be read ({e})") from None
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{config_file}: peft_type is {config.get('peft_type')!r}; tpplan "
                         "loads LoRA adapters only")
    for key in ("use_dora", "fan_in_fan_out"):
        if config.get(key):
            raise ValueError(f"{config_file}: {key} is true; tpplan's LoRA has no {key}")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError(f"{config_file}: per-module ranks or alphas (rank_pattern, "
                         "alpha_pattern) are not supported: one rank and alpha for all targets")
    return config, {from_peft_name(k): v for k, v in load_file(weights).items()}
