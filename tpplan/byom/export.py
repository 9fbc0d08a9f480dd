"""``tpplan export``: a sharded training checkpoint -> one ``model.safetensors``.

Runs in one process without a GPU or a process group. The DCP checkpoint's metadata says
every parameter's global shape; tpplan allocates the full tensors and lets DCP read each
shard into place (``torch.distributed.checkpoint.load`` without a process group), reading
only the ``model.*`` entries, never the optimizer state.

Next to the weights it writes ``config.json`` for a HuggingFace model (so
``AutoModelForCausalLM.from_pretrained(out)`` loads it) or ``tpplan-model.json`` for a
built-in or factory model (so :func:`load_exported` rebuilds it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..api import load
from ..checkpoint import find_checkpoint, read_model_state
from ..models import build_model
from ..models.hf import hf_config
from ..plan.errors import PlanError, PlanErrors
from ..plan.specs import ModelSpec

__all__ = ["export_checkpoint", "load_exported", "find_plan"]

SPEC_FILE = "tpplan-model.json"


def _checkpoint(path: Path) -> Path:
    found = find_checkpoint(path)
    if found is None:
        raise PlanErrors([PlanError(f"no complete checkpoint at '{path}' (a step-NNNNNN folder "
                                    "with .metadata and trainer.pt, or a run folder holding one)")])
    return found


def find_plan(checkpoint: Path) -> Path:
    """The resolved plan the run wrote (``<run>/plan.yaml``) above a checkpoint."""
    for folder in list(checkpoint.parents)[:3]:
        if (folder / "plan.yaml").is_file():
            return folder / "plan.yaml"
    raise PlanErrors([PlanError(f"no plan.yaml found above '{checkpoint}'; pass --plan with the "
                                "plan the run used")])


def export_checkpoint(checkpoint: Path, out: Path, plan_path: Path | None = None,
                      dtype: str | None = None) -> dict[str, Any]:
    """Write ``out/model.safetensors`` and the model's description; return a summary."""
    from safetensors.torch import save_file

    checkpoint = _checkpoint(Path(checkpoint))
    plan = load(plan_path or find_plan(checkpoint))
    state = read_model_state(checkpoint)
    if not state:
        raise PlanErrors([PlanError(f"'{checkpoint}' holds no model tensors")])
    if dtype:
        state = {k: v.to(getattr(torch, dtype)) if v.is_floating_point() else v
                 for k, v in state.items()}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "model.safetensors.tmp"
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / "model.safetensors")
    spec = plan.model
    if spec.is_hf:
        config = hf_config(spec)
        if spec.hf:
            config.architectures = [spec.hf]
        config.save_pretrained(str(out))
    else:
        (out / SPEC_FILE).write_text(json.dumps(
            {"name": spec.name, "config": spec.config, "factory": spec.factory,
             "kwargs": spec.kwargs}, indent=1) + "\n")
    return {"checkpoint": str(checkpoint), "out": str(out), "tensors": len(state),
            "parameters": sum(v.numel() for v in state.values())}


def load_exported(out: str | Path) -> nn.Module:
    """The built-in or factory model an export describes, with its weights loaded."""
    from safetensors.torch import load_file

    out = Path(out)
    desc = json.loads((out / SPEC_FILE).read_text())
    model = build_model(ModelSpec(**desc), device="cpu")
    missing, unexpected = model.load_state_dict(load_file(str(out / "model.safetensors")),
                                                strict=False)
    if unexpected or [m for m in missing if m in dict(model.named_parameters())]:
        raise ValueError(f"export does not fit the model: missing {missing}, unexpected {unexpected}")
    return model
