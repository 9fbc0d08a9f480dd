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
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException

from ..api import load
from ..checkpoint import (
    Damaged, check_contents, check_structure, find_checkpoint, read_model_state,
)
from ..checkpoint.integrity import SafeReader
from ..models import build_model
from ..models.hf import hf_config
from ..plan.errors import CommandError, PlanError, PlanErrors
from ..plan.specs import ModelSpec
from .outputs import atomic_output, model_inputs, refuse_inputs, write_text

__all__ = ["checked_checkpoint", "export_checkpoint", "find_plan", "load_exported", "read_failure",
           "read_weights"]

SPEC_FILE = "tpplan-model.json"


def checked_checkpoint(path: Path) -> Path:
    """The checkpoint ``path`` names (a step folder, or the latest complete one of a run or
    ``checkpoints`` folder), checked against its manifest first (sizes, then every file's
    SHA-256, as ``--resume`` does): a missing, damaged or unreadable one is one error naming
    the file and the problem."""
    checkpoint = find_checkpoint(Path(path))
    if checkpoint is None:
        raise PlanErrors([PlanError(f"no complete checkpoint at '{path}' (a step-NNNNNN folder "
                                    "with .metadata, trainer.json and manifest.json, or a run "
                                    "folder holding one)")])
    try:
        check_structure(checkpoint)
        problems = check_contents(checkpoint)  # no process group: this process hashes all
    except Damaged as e:
        raise CommandError(f"checkpoint {checkpoint} cannot be read: {e}") from None
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CommandError(f"checkpoint {checkpoint} is damaged: {problems[0]}{more}")
    return checkpoint


def read_failure(checkpoint: Path, error: BaseException) -> CommandError:
    """A checkpoint that passed the checks but does not read, as one line."""
    return CommandError(f"checkpoint {checkpoint} cannot be read: {_diagnose(checkpoint, error)}")


def read_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a :func:`checked_checkpoint`, all at once."""
    try:
        return read_model_state(checkpoint)
    except (Exception, CheckpointException) as e:  # DCP's own exception is a BaseException
        raise read_failure(checkpoint, e) from None


def _diagnose(checkpoint: Path, error: BaseException) -> str:
    """For a checkpoint without a manifest (written before tpplan kept one) that passed the
    checks but does not read: which file is broken and how (a shard missing or shorter than
    the metadata says), else the reader's own error."""
    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]  # (exception, traceback) of a rank
    if isinstance(error, Damaged):
        return str(error)
    # The first sentence only: torch's advice to retry with weights_only=False is not one
    # to pass on about a file that does not parse.
    text = str(error).strip().splitlines()[0].split(". ")[0] if str(error).strip() else ""
    reason = f"corrupt or unreadable ({type(error).__name__}{': ' + text if text else ''})"
    try:
        meta = SafeReader(str(checkpoint)).read_metadata()  # never plain pickle: runs no code
    except Damaged as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - any way it fails to read
        return f"{checkpoint / '.metadata'}: cannot be read ({type(e).__name__}: {e})"
    needed: dict[str, int] = {}
    for index, info in (meta.storage_data or {}).items():
        if index.fqn.startswith("model."):
            end = info.offset + info.length
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        file = checkpoint / name
        if not file.is_file():
            return f"{file}: missing (the checkpoint's metadata lists it)"
        size = file.stat().st_size
        if size < end:
            return (f"{file}: truncated ({size:,} bytes; the checkpoint's metadata needs at "
                    f"least {end:,})")
    return f"{checkpoint / next(iter(needed))}: {reason}" if len(needed) == 1 else reason


def check_fits_plan(checkpoint: Path, spec: ModelSpec) -> None:
    """The checkpoint's model tensors are the plan's model's, name for name and shape for
    shape (from the checkpoint's metadata, before anything is read); else one error at the
    plan's ``model`` line naming the first differences. An export of weights under another
    model's names or shapes would load into nothing, or fail only where it is used."""
    from ..checkpoint.stream import ModelTensors

    try:
        tensors = ModelTensors(checkpoint)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - one line, as export says
        raise read_failure(checkpoint, e) from None
    stored = {n: tensors.shape(n) for n in tensors.names()}
    model = build_model(spec, "meta")
    wanted = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    missing = [n for n, _ in model.named_parameters() if n not in stored]
    extra = [n for n in stored if n not in wanted]
    wrong = [f"{n} {list(stored[n])} (the plan's model: {list(shape)})"
             for n, shape in wanted.items() if n in stored and stored[n] != shape]
    problems = [f"{what}: {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"
                for what, names in ((f"{len(missing)} of the model's tensors are not in it",
                                     missing), (f"{len(wrong)} have other shapes", wrong),
                                    (f"{len(extra)} of its tensors are not the model's", extra))
                if names]
    if problems:
        what = spec.factory or spec.hf or spec.hf_config or f"{spec.name} {spec.config or 'debug'}"
        raise PlanErrors([PlanError(f"checkpoint {checkpoint} does not fit this plan's model "
                                    f"({what}): {'; '.join(problems)}; pass --plan with the "
                                    "plan the run used", spec.loc)])


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

    checkpoint = checked_checkpoint(Path(checkpoint))
    plan = load(plan_path or find_plan(checkpoint))
    if plan.lora is not None:  # its checkpoint holds the adapters, not the model
        raise CommandError("this run trained LoRA adapters (the plan's 'lora' section): export "
                           "them with --format peft, or merged into the base with --merge")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise CommandError(f"cannot write to '{out}': it is a file; -o names a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CommandError(f"cannot create the folder '{out}': {e.strerror}") from None
    spec = plan.require_model()
    inputs = model_inputs(plan.document, spec)
    for name in ("model.safetensors", "config.json" if spec.is_hf else SPEC_FILE):
        refuse_inputs(out / name, inputs)  # before anything is written
    check_fits_plan(checkpoint, spec)  # from the metadata, before the weights are read
    state = read_weights(checkpoint)
    if not state:
        raise PlanErrors([PlanError(f"'{checkpoint}' holds no model tensors")])
    if dtype:
        state = {k: v.to(getattr(torch, dtype)) if v.is_floating_point() else v
                 for k, v in state.items()}
    with atomic_output(out / "model.safetensors") as tmp:
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata={"format": "pt"})
    if spec.is_hf:
        config = hf_config(spec)
        if spec.hf:
            config.architectures = [spec.hf]
        with atomic_output(out / "config.json") as tmp, \
                tempfile.TemporaryDirectory(dir=out) as folder:
            config.save_pretrained(folder)  # transformers' own checks and format
            os.replace(Path(folder) / "config.json", tmp)
    else:
        write_text(out / SPEC_FILE, json.dumps(
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
