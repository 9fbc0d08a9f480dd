"""HuggingFace safetensors checkpoints into an already-parallelized model, slice by slice.

:func:`read_index` reads only the folder's index and each file's safetensors header (names,
shapes, dtypes; no tensor data), so a missing shard, a missing or unexpected tensor and a
wrong shape are all found before the process group starts. :func:`load` then hands the
model's own (sharded) state dict to DCP's :class:`HuggingFaceStorageReader`: each rank reads
only the slices of each tensor it holds -- whatever the TP and FSDP placements -- and copies
them into its shards, converting the dtype on the way. No rank ever holds more than its
shards plus one slice being copied.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from ..plan.packing import packed_params

__all__ = ["INDEX", "TensorInfo", "compress_names", "load", "mismatches", "read_index"]

INDEX = "model.safetensors.index.json"
# Buffers some checkpoints still carry that every model recomputes (transformers ignores them).
IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$|(^|\.)masked_bias$|(^|\.)attn\.bias$")
MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: F32, BF16, ...
    file: str


def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        size_bytes = f.read(8)
        if len(size_bytes) < 8:
            raise ValueError("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", size_bytes)
        if n > MAX_HEADER:
            raise ValueError("not a safetensors file (header length out of range)")
        head = json.loads(f.read(n))
    head.pop("__metadata__", None)
    end = max((v["data_offsets"][1] for v in head.values()), default=0)
    if path.stat().st_size < 8 + n + end:
        raise ValueError(f"truncated: {path.stat().st_size} bytes, the header promises {8 + n + end}")
    return head


def read_index(folder: Path) -> tuple[dict[str, TensorInfo], list[str]]:
    """Every tensor of the checkpoint in ``folder`` and what is wrong with the folder itself
    (a shard the index names that is not there or cannot be read)."""
    problems: list[str] = []
    index = folder / INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            return {}, [f"{index}: not a safetensors index ({type(e).__name__}: {e})"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            other = sorted(p.name for p in folder.glob("*.bin")) + sorted(
                p.name for p in folder.glob("*.pt"))
            extra = f" (it has {', '.join(other[:3])}; tpplan reads safetensors only)" if other else ""
            return {}, [f"{folder}: no *.safetensors and no {INDEX}{extra}"]
    found: dict[str, TensorInfo] = {}
    for name in files:
        path = folder / name
        if not path.exists():
            held = sum(1 for f in weight_map.values() if f == name) if index.exists() else 0
            problems.append(f"{path}: missing (the index puts {held} tensor(s) in it)")
            continue
        try:
            head = _header(path)
        except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
            problems.append(f"{path}: cannot be read ({e})")
            continue
        for key, v in head.items():
            found[key] = TensorInfo(tuple(v["shape"]), v["dtype"], name)
    return found, problems


def compress_names(names) -> list[str]:
    """``a.3.b``, ``a.4.b``, ``a.5.b`` -> ``a.{3-5}.b``: every name still said, once."""
    groups: dict[str, list[int]] = {}
    singles = []
    for n in sorted(names):
        m = re.search(r"\.(\d+)\.", n)
        if m:
            groups.setdefault(n[:m.start()] + ".{}." + n[m.end():], []).append(int(m.group(1)))
        else:
            singles.append(n)
    out = list(singles)
    for pattern, idx in groups.items():
        idx = sorted(set(idx))
        spans, start = [], idx[0]
        for a, b in zip(idx, idx[1:] + [None]):
            if b != a + 1:
                spans.append(str(start) if start == a else f"{start}-{a}")
                start = b
        out.append(pattern.replace("{}", spans[0] if len(idx) == 1 else "{" + ",".join(spans) + "}"))
    return sorted(out)


def mismatches(expected: dict[str, tuple[str, tuple[int, ...]]], found: dict[str, TensorInfo],
               optional: set[str] = frozenset(), aliases: dict[str, str] | None = None) -> list[str]:
    """What keeps the checkpoint from filling the model: missing tensors, unexpected ones,
    wrong shapes -- every one named (layers grouped). ``optional``: names the model shares
    with another (tied) that a checkpoint may hold or not; ``aliases``: a missing name read
    from another (a tied head from the embedding)."""
    aliases = aliases or {}
    missing = [n for n in expected if n not in found and aliases.get(n) not in found]
    unexpected = [n for n in found if n not in expected and n not in optional
                  and not IGNORED.search(n)]
    wrong = [f"{n} is {list(found[n].shape)} in the checkpoint, {list(shape)} in the model"
             for n, (_, shape) in expected.items() if n in found and found[n].shape != shape]
    out = []
    if missing:
        out.append(f"missing {len(missing)}: {', '.join(compress_names(missing))}")
    if unexpected:
        out.append(f"unexpected {len(unexpected)}: {', '.join(compress_names(unexpected))}")
    if wrong:
        out.append(f"wrong shape: {'; '.join(wrong)}")
    return out


def load(folder: Path, model: nn.Module, to_hf, names: set[str],
         aliases: dict[str, str] | None = None, conversion=None) -> int:
    """Read the checkpoint in ``folder`` into ``model`` (materialized, parallelized or not):
    the tensors whose checkpoint names (``to_hf`` of the model's) are in ``names`` -- a tied
    tensor once. ``aliases``: model tensors (by checkpoint name) read from another checkpoint
    tensor. ``conversion`` (:class:`~tpplan.checkpoint.hf_convert.Conversion`): model tensors
    the checkpoint holds renamed or per expert. Returns the number of tensors read."""
    from .hf_convert import Conversion, ConvertingLoadPlanner

    aliases = aliases or {}
    conversion = conversion or Conversion()
    state = get_model_state_dict(model)
    by_hf: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        hf = to_hf(name)
        if hf in names:
            by_hf[hf] = t
    # under the checkpoint's names; per-expert ones stay under the model's (hf_convert)
    name = conversion.checkpoint_name
    direct = {name(k): v for k, v in by_hf.items() if k not in aliases}
    reader = HuggingFaceStorageReader(str(folder))
    # packed parameters: each rank reads its slice of every part (packed_io)
    packed = {name(to_hf(n)): p for n, p in packed_params(model).items()}
    dcp.load(direct, storage_reader=reader,
             planner=ConvertingLoadPlanner(packed, conversion.fused))
    for target, source in aliases.items():
        if target in by_hf:
            dcp.load({source: by_hf[target]}, storage_reader=HuggingFaceStorageReader(str(folder)))
    set_model_state_dict(model, state)
    return len(by_hf)
