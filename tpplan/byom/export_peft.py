"""``tpplan export --format peft`` and ``--merge``: a LoRA run's checkpoint out of tpplan.

A LoRA checkpoint holds the adapters (and ``modules_to_save``), not the frozen base. The
PEFT format writes them as PEFT's folder (``adapter_config.json`` +
``adapter_model.safetensors``), which ``peft.PeftModel.from_pretrained(base, out)`` loads.
``--merge`` writes a whole HuggingFace folder: the base's safetensors files (from the
plan's ``model.pretrained``), one file at a time, with ``W + B @ A * scaling`` in place of
each target's weight and the trained ``modules_to_save``; its config, index and tokenizer
files copied. Both on one CPU process, written into a temporary folder renamed at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..api import load
from ..checkpoint.peft_format import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_config, to_peft_name
from ..models import build_model
from ..models.pretrained import pretrained_dir
from ..parallel.lora.adapters import lora_targets, saved_modules
from ..plan.errors import CommandError
from .export import checked_checkpoint, find_plan, read_weights
from .export_hf import prepare_out_folder
from .tokenizer_files import copy_tokenizer_files

__all__ = ["export_peft", "export_merged"]

BASE_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json")


def _lora_run(checkpoint: Path, plan_path: Path | None):
    checkpoint = checked_checkpoint(Path(checkpoint))
    plan = load(plan_path or find_plan(checkpoint))
    if plan.lora is None:
        raise CommandError(f"the plan of {checkpoint} has no 'lora' section: --format peft and "
                           "--merge export LoRA runs; use --format hf for a full fine-tune")
    if not plan.model.is_hf:
        raise CommandError("--format peft and --merge export HuggingFace models (PEFT names "
                           "their modules); this plan's model is not one")
    state = read_weights(checkpoint)
    model = build_model(plan.model, "meta")
    paths = [p for p, _ in model.named_modules()]
    return checkpoint, plan, state, lora_targets(plan.lora, paths), saved_modules(plan.lora, paths)


def _publish(tmp: Path, out: Path) -> None:
    os.chmod(tmp, 0o755)
    os.replace(tmp, out)


def _write(out: Path, fill) -> None:
    out = Path(out)
    prepare_out_folder(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        fill(tmp)
        _publish(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CommandError(f"cannot write '{out}': {e.strerror or e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def export_peft(checkpoint: Path, out: Path, plan_path: Path | None = None,
                dtype: str | None = None) -> dict[str, Any]:
    """Write PEFT's adapter folder ``out`` from a LoRA run's checkpoint; a summary."""
    from safetensors.torch import save_file

    checkpoint, plan, state, targets, saved = _lora_run(checkpoint, plan_path)
    cast = getattr(torch, dtype) if dtype else None
    tensors = {to_peft_name(k): (v.to(cast) if cast and v.is_floating_point() else v)
               .contiguous() for k, v in state.items()}
    base = str(pretrained_dir(plan.model).resolve()) if plan.model.pretrained else None
    config = adapter_config(plan.lora, targets, saved, base)

    def fill(tmp: Path) -> None:
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")

    _write(out, fill)
    return {"checkpoint": str(checkpoint), "out": str(out), "tensors": len(tensors),
            "parameters": sum(v.numel() for v in tensors.values()), "targets": len(targets)}


def export_merged(checkpoint: Path, out: Path, plan_path: Path | None = None) -> dict[str, Any]:
    """Write a whole HF folder ``out``: the base with the adapters merged in; a summary."""
    from safetensors.torch import load_file, save_file

    checkpoint, plan, state, targets, saved = _lora_run(checkpoint, plan_path)
    if not plan.model.pretrained:
        raise CommandError("--merge adds the adapters to the base's weights: the plan has no "
                           "model.pretrained folder to read them from")
    base = pretrained_dir(plan.model)
    scaling = plan.lora.scaling
    deltas = {f"{p}.weight": (p, state[f"{p}.lora_B.weight"].float()
                              @ state[f"{p}.lora_A.weight"].float() * scaling) for p in targets}
    whole = {k: v for k, v in state.items() if ".lora_A." not in k and ".lora_B." not in k}
    merged = set()

    def fill(tmp: Path) -> None:
        for f in sorted(base.glob("*.safetensors")):
            tensors = load_file(f)
            for name, t in tensors.items():
                if name in deltas:
                    tensors[name] = (t.float() + deltas[name][1]).to(t.dtype)
                    merged.add(name)
                elif name in whole:
                    tensors[name] = whole[name].to(t.dtype)
                    merged.add(name)
            save_file(tensors, str(tmp / f.name), metadata={"format": "pt"})
        for name in BASE_FILES:
            if (base / name).is_file():
                shutil.copy2(base / name, tmp / name)
        copy_tokenizer_files(base, tmp)
        missing = (deltas.keys() | whole.keys()) - merged
        if missing:
            raise CommandError(f"the base {base} lacks {len(missing)} tensors the adapters "
                               f"change ({', '.join(sorted(missing)[:3])})")

    _write(out, fill)
    return {"checkpoint": str(checkpoint), "out": str(out), "base": str(base),
            "merged": len(deltas), "saved": len(whole)}
