"""Starting from HF weights (``model.pretrained``): checked before the process group starts,
read slice by slice after the model is parallelized.

:func:`check` compares the folder's tensors (headers only) with the model's, on every rank
alike, and raises located errors naming every missing, unexpected and wrongly-shaped
tensor and every missing shard. :func:`load` then reads each rank's own slices.
"""

from __future__ import annotations

import json
import tempfile
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..api import load as load_plan
from ..checkpoint import hf_weights
from ..checkpoint.hf_convert import Conversion, conversion
from ..models import build_model, materialize
from ..models.pretrained import expected_tensors, hf_name_map, pretrained_dir
from ..parallel.mesh import dp_rank
from ..parallel.runtime import as_spawned_rank, spawn
from ..plan import ErrorList
from ..plan.specs import ModelSpec

__all__ = ["Pretrained", "check", "first_logits", "load"]

DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64",
          "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


@dataclass
class Pretrained:
    folder: Path
    names: set[str]  # checkpoint names to read
    aliases: dict[str, str] = field(default_factory=dict)  # model tensor <- checkpoint tensor
    dtypes: str = ""  # the checkpoint's dtypes, e.g. "bfloat16"
    conversion: Conversion | None = None  # tensors held renamed or per expert (hf_convert)

    def describe(self) -> str:
        experts = ", experts one tensor each" if self.conversion and self.conversion.fused else ""
        return f"pretrained {self.folder} ({len(self.names)} tensors, {self.dtypes}{experts})"


def _tied(folder: Path) -> bool:
    try:
        return bool(json.loads((folder / "config.json").read_text()).get("tie_word_embeddings"))
    except (OSError, ValueError, AttributeError):
        return False


def check(spec: ModelSpec, model: nn.Module) -> Pretrained:
    """What ``model.pretrained`` holds against ``model`` (unparallelized, on meta): every
    problem at once, located at the ``pretrained`` line."""
    folder = pretrained_dir(spec)
    loc = spec.locs.get("pretrained", spec.loc)
    errs = ErrorList()
    if not folder.is_dir():
        errs.add(f"model.pretrained: '{folder}' is not a folder (an HF checkpoint: config.json "
                 f"and *.safetensors)", loc)
        errs.raise_if_any()
    found, problems = hf_weights.read_index(folder)
    converted = conversion(model, found)  # per-expert MoE tensors, as transformers maps them
    problems += converted.problems
    found = converted.as_model(found)
    expected = {k: v for k, v in expected_tensors(model).items() if k not in converted.failed}
    to_hf = hf_name_map(model)
    everything = {to_hf(n) for n in model.state_dict()} - {None}
    aliases = {}
    if _tied(folder) and "lm_head.weight" in expected and "lm_head.weight" not in found:
        aliases["lm_head.weight"] = "model.embed_tokens.weight"  # a tied head, held untied
    for p in problems + (hf_weights.mismatches(expected, found, everything - set(expected),
                                               aliases) if found else []):
        errs.add(f"model.pretrained: {p}", loc)
    errs.raise_if_any()
    kinds = Counter(DTYPES.get(found[n].dtype, found[n].dtype) for n in expected if n in found)
    return Pretrained(folder, set(expected), aliases, ", ".join(sorted(kinds)), converted)


def load(source: Pretrained, model: nn.Module) -> str:
    """Read the checkpoint into the parallelized, materialized model; the header's word for it."""
    hf_weights.load(source.folder, model, hf_name_map(model), source.names, source.aliases,
                    source.conversion)
    return source.describe()


def _logits_worker(rank: int, world: int, port: int, plan_path: str, overrides: list[str],
                   tokens: torch.Tensor, out: str) -> None:
    as_spawned_rank(rank, world, port)
    warnings.simplefilter("ignore")
    plan = load_plan(plan_path, overrides)
    model = build_model(plan.require_model(), device="meta", real_buffers=True)
    source = check(plan.model, model)
    mesh = plan.build_mesh("cpu")
    try:
        model = plan.apply(model, mesh)
        materialize(model, "cpu")
        load(source, model)
        model.eval()
        dims = plan.parallel_dims(world)
        local = tokens.chunk(dims.dp)[dp_rank(mesh)]
        with torch.no_grad(), plan.loss_context():
            logits = model(local)
        logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
        if mesh["tp"].get_local_rank() == 0:
            torch.save(logits, Path(out) / f"dp{dp_rank(mesh)}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def first_logits(plan_path: str, overrides: list[str], world_size: int,
                 tokens: torch.Tensor) -> torch.Tensor:
    """Logits of ``tokens`` (batch, seq) from the plan's model as ``tpplan train`` starts it:
    built on meta, parallelized on ``world_size`` gloo processes, pretrained weights read
    slice by slice. The whole batch, gathered: to hold against transformers' own forward."""
    with tempfile.TemporaryDirectory(prefix="tpplan-load-") as out:
        spawn(_logits_worker, world_size, plan_path, list(overrides), tokens, out)
        return torch.cat([torch.load(p) for p in sorted(Path(out).glob("dp*.pt"))])


def plan_problems(plan_path: str, overrides) -> list:
    """``model.pretrained`` of the plan at ``plan_path`` checked against its model, for
    ``validate``: the located errors, or none (a plan that does not load, or has no
    ``pretrained``, is the dry run's to report)."""
    from ..plan import PlanErrors

    try:
        plan = load_plan(plan_path, overrides)
        if not plan.model or not plan.model.pretrained:
            return []
        check(plan.model, build_model(plan.require_model(), device="meta", real_buffers=True))
    except PlanErrors as e:
        return list(e.errors)
    return []


def base_identity(spec: ModelSpec, seed: int) -> dict:
    """What a LoRA checkpoint's frozen base was: ``model.pretrained``'s folder and the
    SHA-256 of its safetensors index (or its single ``model.safetensors``), or the seed of
    a randomly initialized base. A resume on another base is refused."""
    import hashlib

    if not spec.pretrained:
        return {"pretrained": None, "seed": seed}
    folder = pretrained_dir(spec)
    index = folder / "model.safetensors.index.json"
    target = index if index.is_file() else folder / "model.safetensors"
    digest = hashlib.sha256()
    with open(target, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return {"pretrained": str(folder.resolve()), "file": target.name,
            "sha256": digest.hexdigest()}


def _peft_matches(targets, path: str) -> bool:
    """PEFT's own rule: a regex string matches the whole path, a list entry the path or a
    dotted suffix of it."""
    import re

    if isinstance(targets, str):
        return re.fullmatch(targets, path) is not None
    return any(path == t or path.endswith("." + t) for t in targets or [])


def check_adapter(plan, model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.adapter``'s PEFT folder against the plan's ``lora`` and ``model`` (on meta,
    before adapters are added): its rank, alpha and targets, every tensor's name and shape.
    Returns its tensors under tpplan's names; located errors at ``model.adapter``."""
    from ..checkpoint.peft_format import read_adapter
    from ..parallel.lora.adapters import lora_targets, saved_modules
    from ..plan.errors import PlanError, PlanErrors

    spec, lora = plan.model, plan.lora
    loc = spec.locs.get("adapter", spec.loc)
    folder = spec.path(spec.adapter)
    try:
        config, tensors = read_adapter(folder)
    except ValueError as e:
        raise PlanErrors([PlanError(f"model.adapter: {e}", loc)]) from None
    errs = ErrorList()
    for key, ours in (("r", lora.rank), ("lora_alpha", lora.alpha), ("use_rslora", lora.rslora)):
        if config.get(key, False if key == "use_rslora" else None) != ours:
            errs.add(f"model.adapter: {folder}'s adapter_config.json has {key} "
                     f"{config.get(key)!r} but the plan's lora section says {ours!r}", loc)
    modules = dict(model.named_modules())
    ours = set(lora_targets(lora, list(modules)))
    theirs = {p for p, m in modules.items() if p and isinstance(m, nn.Linear)
              and _peft_matches(config.get("target_modules"), p)}
    if ours != theirs:
        diff = sorted(ours ^ theirs)
        errs.add(f"model.adapter: {folder} adapts other modules than the plan's lora.targets "
                 f"({len(diff)} differ, e.g. {', '.join(diff[:3])})", loc)
    expected = {}
    for p in ours:
        m = modules[p]
        expected[f"{p}.lora_A.weight"] = (lora.rank, m.in_features)
        expected[f"{p}.lora_B.weight"] = (m.out_features, lora.rank)
    for p in saved_modules(lora, list(modules)):
        expected.update({f"{p}.{n}": tuple(t.shape) for n, t in
                         modules[p].named_parameters()})
    wrong = [f"{n} {list(t.shape)} (the plan's: {list(expected[n])})"
             for n, t in tensors.items() if n in expected and tuple(t.shape) != expected[n]]
    unknown = sorted(set(tensors) - set(expected))
    missing = sorted(set(expected) - set(tensors))
    for what, names in (("tensors of other shapes", wrong), ("tensors the plan has no place "
                        "for", unknown), ("no tensor for", missing)):
        if names and not errs:
            errs.add(f"model.adapter: {folder} has {what}: {', '.join(names[:3])}"
                     f"{' ...' if len(names) > 3 else ''}", loc)
    errs.raise_if_any()
    return tensors


@torch.no_grad()
def load_adapter(tensors: dict[str, torch.Tensor], parts: list[nn.Module]) -> int:
    """Copy a PEFT adapter's tensors (full, tpplan's names) into the parallelized model:
    each rank keeps its own slice. Returns how many were copied."""
    from torch.distributed.tensor import distribute_tensor

    n = 0
    for part in parts:
        for name, p in part.named_parameters():
            full = tensors.get(name)
            if full is None:
                continue
            full = full.to(dtype=p.dtype)
            if isinstance(p, DTensor):
                shard = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
                p.to_local().copy_(shard.to_local())
            else:
                p.copy_(full.to(p.device))
            n += 1
    return n
