"""LoRA's sizes from the plan, with or without the adapters in the model yet: what the dry run
and the preflight read (FSDP unit sizes, the checkpoint's size, whether shallow traces may
extrapolate). The adapters themselves: :mod:`tpplan.parallel.lora.adapters`."""

from __future__ import annotations

import math
from typing import Callable

from torch import nn

from ...plan.patterns import generalize
from ...plan.specs import LoraSpec
from .adapters import FOLLOWED_STYLES, lora_targets, saved_modules, style_of

__all__ = ["adapter_shapes", "adapter_tp_dim", "checkpointed", "same_in_every_block",
           "trained_names"]


def adapter_shapes(spec: LoraSpec, model: nn.Module) -> dict[str, tuple[int, int]]:
    """The global shape of every adapter weight :func:`apply_lora` adds to ``model``, by
    parameter name, read from a model with or without them (the dry run's arithmetic on a
    model not yet parallelized: FSDP unit sizes, checkpoint size)."""
    modules = dict(model.named_modules())
    out = {}
    for path in lora_targets(spec, [p for p in modules if not p.endswith((".lora_A", ".lora_B"))]):
        base = modules[path]
        if not isinstance(base, nn.Linear):  # check_lora's error
            continue
        out[f"{path}.lora_A.weight"] = (spec.rank, base.in_features)
        out[f"{path}.lora_B.weight"] = (base.out_features, spec.rank)
    return out


def adapter_tp_dim(name: str, rule_of: dict) -> int | None:
    """The dimension tp splits adapter weight ``name`` along (its base's style decides:
    :data:`FOLLOWED_STYLES`); None when replicated, or when ``name`` is no adapter's."""
    for part, which in ((".lora_A.", 0), (".lora_B.", 1)):
        base, found, _ = name.partition(part)
        if found:
            style = style_of(base, rule_of)[0]
            place = FOLLOWED_STYLES.get(style, (None, None))[which]
            return place if isinstance(place, int) else None
    return None


def trained_names(spec: LoraSpec, model: nn.Module) -> set[str]:
    """The parameters that train under ``spec`` (the adapters' and ``modules_to_save``'s),
    with or without the adapters in ``model`` yet, as :func:`freeze_base` leaves them."""
    out = set(adapter_shapes(spec, model))
    for path in saved_modules(spec, [p for p, _ in model.named_modules()]):
        out |= {f"{path}.{n}" for n, _ in model.get_submodule(path).named_parameters()}
    return out


def same_in_every_block(plan, model: nn.Module | Callable[[], nn.Module]) -> bool:
    """Whether ``plan``'s ``lora`` and ``freeze`` choose alike in every repeated block (a
    block's parameter is chosen iff its kin in every other block is), as the dry run's
    shallow traces assume when they extrapolate from a model's first blocks. ``model``: a
    module, or what builds one (with a ``read``, as a :class:`~tpplan.parallel.pipeline.split.
    StageBuilder`, read in place): built only where
    the plan has ``lora`` or ``freeze`` (without them the answer needs no module)."""
    from ..freeze import frozen_names

    if plan.lora is None and not plan.freeze:
        return True
    if hasattr(model, "read"):  # a StageBuilder, or the dry run's ModelBuilder: no copy
        return model.read(lambda stage: same_in_every_block(plan, stage))
    if not isinstance(model, nn.Module):
        model = model()
    names = [n for n, _ in model.named_parameters()]
    paths = [p for p, _ in model.named_modules()]
    universe = set(names) | set(paths)
    chosen = []
    if plan.lora is not None:  # the targets (modules) and what trains whole (parameters)
        chosen.append(set(lora_targets(plan.lora, paths)) |
                      (trained_names(plan.lora, model) & set(names)))
    if plan.freeze:
        chosen.append(frozen_names(plan.freeze, names))
    for picked in chosen:
        general = {generalize(n) for n in picked}
        if picked != {n for n in universe if generalize(n) in general}:
            return False
    return True


def checkpointed(spec: LoraSpec | None, model: nn.Module) -> list[tuple[int, int]] | None:
    """(elements, bytes per element) of each parameter a LoRA run's checkpoint holds (what
    trains: the adapters, ``modules_to_save``), from a model with or without its adapters;
    None without ``lora`` (a checkpoint holds every parameter)."""
    if spec is None:
        return None
    params = dict(model.named_parameters())
    shapes = adapter_shapes(spec, model)
    out = []
    for name in sorted(trained_names(spec, model)):
        if name in params:
            out.append((params[name].numel(), params[name].element_size()))
        else:  # an adapter not added yet: its base's dtype
            base = params[name.rsplit(".lora_", 1)[0] + ".weight"]
            out.append((math.prod(shapes[name]), base.element_size()))
    return out
