"""``tpplan export --format hf``: a sharded training checkpoint -> a HuggingFace model folder.

What ``AutoModelForCausalLM.from_pretrained(out)`` and ``AutoTokenizer.from_pretrained(out)``
load: ``config.json``, the weights as safetensors shards of at most ``max_shard_size`` (with
``model.safetensors.index.json`` when there are several), and the tokenizer's files.

Streamed, never gathered: each tensor is read from the DCP checkpoint on its own
(:class:`~tpplan.checkpoint.stream.ModelTensors`), converted, written into its shard and
dropped, so the process holds one tensor at a time whatever the model's size.

Names: an HF model's state-dict names are HF's own. The built-in Llama's are mapped with
:mod:`tpplan.models.hf_llama`; trained from scratch (``rope_layout: interleaved``) its q/k
rows are permuted within each head (:func:`~tpplan.models.hf_llama.interleaved_to_half`),
so HF's rotate-half RoPE computes the same logits. A mixture of experts' fused ``[E, ...]``
experts are written in the layout the run's ``model.pretrained`` folder holds them -- one
tensor per expert (``experts.N.gate_proj.weight``, Mixtral's ``block_sparse_moe.experts.N.w1``)
or fused -- and without such a folder as transformers' own ``save_pretrained`` writes them
(per expert): :mod:`tpplan.checkpoint.hf_convert`, one fused tensor held at a time.

Atomic: everything is written into a temporary folder beside ``out``, renamed to ``out`` at
the end; a failure removes it. ``out`` must be new or empty, so nothing the export reads (the
checkpoint, the plan, the tokenizer) can be written over.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from ..api import load
from ..checkpoint import hf_weights
from ..checkpoint.hf_convert import Conversion, conversion, saved_names
from ..checkpoint.stream import ModelTensors
from ..models import build_model
from ..models.hf import causal_lm_for, hf_config
from ..models.hf_llama import hf_config_dict, interleaved_to_half, is_rotary
from ..models.introspect import vocab_size
from ..models.pretrained import expected_tensors, pretrained_dir
from ..plan.errors import CommandError
from ..plan.specs import torch_dtype
from .export import checked_checkpoint, find_plan, read_failure
from .safetensors_out import Entry, parse_size, write_sharded
from .tokenizer_files import copy_tokenizer_files, plan_tokenizer, tokenizer_vocab

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "export_hf"]

DEFAULT_MAX_SHARD_SIZE = "5GB"


def _entries(model, tensors: ModelTensors, dtype: torch.dtype | None, layout: Conversion):
    """(Entry in HF's name, the checkpoint's name, permute q/k rows, the fused tensor it is
    a piece of) for every tensor the model holds -- per expert where ``layout`` says so; a
    tensor the checkpoint lacks or holds in another shape is an error."""
    interleaved = getattr(getattr(model, "config", None), "rope_layout", None) == "interleaved"
    out, missing, wrong = [], [], []
    for hf_name, (name, shape) in expected_tensors(model).items():
        if name not in tensors:
            missing.append(name)
            continue
        if tensors.shape(name) != shape:
            wrong.append(f"{name} {list(tensors.shape(name))} (the plan's model: {list(shape)})")
            continue
        stored = tensors.dtype(name)
        target = dtype if dtype is not None and stored.is_floating_point else stored
        fused = layout.fused.get(hf_name)
        if fused is None:
            out.append((Entry(layout.checkpoint_name(hf_name), shape, target), name,
                        interleaved and is_rotary(name), None))
            continue
        for names, part_shape in zip(fused.parts, fused.part_shapes):
            out += [(Entry(n, part_shape, target), name, False, fused) for n in names]
    if missing or wrong:
        what = (f"lacks {len(missing)} of the model's tensors ({', '.join(missing[:3])}"
                f"{', ...' if len(missing) > 3 else ''})" if missing else
                f"holds tensors of other shapes: {'; '.join(wrong[:3])}")
        raise CommandError(f"checkpoint {tensors.path} does not fit the plan's model: {what}")
    return out


def _expert_layout(spec, model) -> Conversion:
    """How to write a MoE's experts: as ``model.pretrained``'s folder holds them (per expert
    or fused), else as transformers' ``save_pretrained`` writes them (per expert, for the
    families its conversion mapping fuses on load). Other models: their own names."""
    if not spec.is_hf:
        return Conversion()
    if spec.pretrained:
        found, _ = hf_weights.read_index(pretrained_dir(spec))
        if found:
            return conversion(model, found)
    return saved_names(model)


def _config_json(spec, model, dtype_name: str) -> str:
    if not spec.is_hf:
        return json.dumps(hf_config_dict(model.config, dtype_name), indent=2) + "\n"
    config = hf_config(spec)
    if spec.hf:
        config.architectures = [spec.hf]
    elif not getattr(config, "architectures", None):
        lm = causal_lm_for(type(config))
        config.architectures = [lm.__name__] if lm is not None else None
    config.dtype = dtype_name
    return config.to_json_string(use_diff=True)


def _check_tokenizer(source: Path, model) -> None:
    """A tokenizer that names ids the model has no embedding row for is refused."""
    if not source.exists():
        raise CommandError(f"cannot read the tokenizer '{source}': no such file or folder")
    try:
        vocab = tokenizer_vocab(source)
    except ValueError as e:
        raise CommandError(str(e)) from None
    rows = vocab_size(model)
    if vocab is not None and rows is not None and vocab > rows:
        raise CommandError(f"the tokenizer {source} has {vocab} tokens, more than the model's "
                           f"vocabulary of {rows}: it is not the tokenizer this model was "
                           "trained with")


def prepare_out_folder(out: Path) -> None:
    """``out`` new or an empty folder, its parent created; else one line, nothing written."""
    if out.exists() and not out.is_dir():
        raise CommandError(f"cannot write to '{out}': it is a file; -o names a folder")
    if out.is_dir() and any(out.iterdir()):
        raise CommandError(f"refusing to write into '{out}': it is not empty (an HF export "
                           "writes a whole folder); remove it or choose another")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CommandError(f"cannot create the folder '{out.parent}': {e.strerror}") from None


def export_hf(checkpoint: Path, out: Path, plan_path: Path | None = None,
              dtype: str | None = None, max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
              tokenizer: Path | None = None) -> dict[str, Any]:
    """Write the HF model folder ``out`` from ``checkpoint``; return a summary."""
    try:
        max_bytes = parse_size(max_shard_size)
    except ValueError as e:
        raise CommandError(f"--max-shard-size: {e}") from None
    checkpoint = checked_checkpoint(Path(checkpoint))
    plan_file = Path(plan_path or find_plan(checkpoint))
    plan = load(plan_file)
    if plan.lora is not None:  # its checkpoint holds the adapters, not the model
        raise CommandError("this run trained LoRA adapters (the plan's 'lora' section): export "
                           "them with --format peft, or merged into the base with --merge")
    spec = plan.require_model()
    if not (spec.is_hf or spec.name == "llama3"):
        raise CommandError("--format hf exports a HuggingFace model (model.hf, hf_config or "
                           "pretrained) or the built-in llama3; this plan's model is "
                           f"'{spec.factory or spec.name}': use the default format")
    model = build_model(spec, "meta")
    try:
        tensors = ModelTensors(checkpoint)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - one line, as export says
        raise read_failure(checkpoint, e) from None
    entries = _entries(model, tensors, torch_dtype(dtype) if dtype else None,
                       _expert_layout(spec, model))
    floats = [e.dtype for e, *_ in entries if e.dtype.is_floating_point]
    dtype_name = str(floats[0] if floats else torch.float32).removeprefix("torch.")
    source = Path(tokenizer) if tokenizer else plan_tokenizer(plan, plan_file)
    if source is not None:
        _check_tokenizer(source, model)
    out = Path(out)
    prepare_out_folder(out)
    head_dim = getattr(getattr(model, "config", None), "head_dim", None)
    by_entry = {e.name: rest for e, *rest in entries}
    held: dict[str, torch.Tensor] = {}  # the one fused tensor its experts are being cut from

    def fetch(entry: Entry) -> torch.Tensor:
        name, permute, fused = by_entry[entry.name]
        try:
            t = held[name] if name in held else tensors.read(name)
        except (Exception, CheckpointException) as e:  # noqa: BLE001
            raise read_failure(checkpoint, e) from None
        if fused is not None:
            held.clear()
            held[name] = t
            t = fused.piece(t, entry.name)
        if permute:
            t = interleaved_to_half(t, head_dim)
        return t.to(entry.dtype)

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        files = write_sharded(tmp, [e for e, *_ in entries], fetch, max_bytes)
        (tmp / "config.json").write_text(_config_json(spec, model, dtype_name))
        copied = copy_tokenizer_files(source, tmp) if source is not None else []
        os.chmod(tmp, 0o777 & ~_umask())  # as mkdir would make it, not mkdtemp's 0700
        os.replace(tmp, out)  # over an empty folder, or none
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CommandError(f"cannot write '{out}': {e.strerror or e}"
                           + (f" ({e.filename})" if e.filename else "")) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"checkpoint": str(checkpoint), "out": str(out), "tensors": len(entries),
            "parameters": sum(_numel(e.shape) for e, *_ in entries), "files": files,
            "dtype": dtype_name, "tokenizer": str(source) if source else None,
            "tokenizer_files": copied}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
