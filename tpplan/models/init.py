"""Weights initialized the same at every mesh shape, without a full replica anywhere.

Each parameter's full tensor is generated on CPU from a generator seeded by the run seed
and the parameter's path (a stable hash, not Python's salted ``hash``), and only this
rank's shard is kept (``distribute_tensor(..., src_data_rank=None)`` slices locally, no
communication). One parameter at a time, so peak extra memory is the largest parameter,
and a single-device run with the same seed gets exactly the same numbers.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from .._torch.modules import own_parameters, set_buffers, set_parameters, shell_copy
from ..plan.packing import Packing, packed_params
from ..plan.specs import ModelSpec
from .build import build_model
from .late_writes import watch_build
from .replay import constructor_modules, replay_constructors

__all__ = ["constructor_problems", "init_adapters", "init_weights", "materialize", "param_seed"]


def materialize(model: nn.Module, device: torch.device | str) -> None:
    """Allocate the meta parameters on ``device``, keeping the buffers computed at build.

    The model was built with real buffers (``build_model(..., real_buffers=True)``): rotary
    tables and the like are derived from the config, and any model's own constructor is the
    one code that knows how. ``to_empty`` would leave them uninitialized, so they are put back.
    """
    buffers = {name: b for name, b in model.named_buffers() if b.device.type != "meta"}
    tied = _tied(model)
    model.to_empty(device=device)
    for (path, name), *others in tied:  # to_empty gives each owner of a shared weight its own
        param = own_parameters(model.get_submodule(path))[name]
        for other, attr in others:
            set_parameters(model.get_submodule(other), {attr: param})
    for name, b in buffers.items():
        set_buffers(model, {name: b.to(device)})


def _tied(model: nn.Module) -> list[list[tuple[str, str]]]:
    """(module path, attribute) of each owner of a parameter shared by several modules."""
    owners: dict[int, list[tuple[str, str]]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for name, p in own_parameters(module).items():
            if p is not None and (path, name) not in owners.get(id(p), []):
                owners.setdefault(id(p), []).append((path, name))
    return [group for group in owners.values() if len(group) > 1]


def param_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _assign(p: torch.Tensor, full: torch.Tensor, packing: Packing | None = None) -> None:
    with torch.no_grad():
        if packing is not None:  # held in tp-interleaved order (tpplan.plan.packing)
            full = full.index_select(packing.dim, torch.tensor(packing.order()))
        if isinstance(p, DTensor):
            shard = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
            p.to_local().copy_(shard.to_local())
        else:
            p.copy_(full)


def init_weights(model: nn.Module, seed: int, device: torch.device | str,
                 spec: ModelSpec | None = None) -> str:
    """Initialize every parameter of a materialized (``to_empty``) model; return the method.

    Models with ``init_std(name)`` (the built-in Llama) get normal(0, std) per parameter
    (std None = ones, a norm weight). Other models: a full-size CPU copy is rebuilt module
    by module with ``reset_parameters()`` under a generator seeded per module path, then
    sharded -- one module's parameters at a time. A module with parameters and no
    ``reset_parameters()`` gets what its constructor writes, and so does a parameter the
    constructor writes after its module is complete (a parent's ``apply(_init_weights)``,
    found by a meta build of ``spec``): the model's constructor is replayed on CPU under
    ``torch.manual_seed(seed)``, so those parameters equal the plain CPU build's
    (:mod:`.replay`); ValueError when that cannot be done.
    """
    if hasattr(model, "init_buffers"):
        model.init_buffers(device)
    packed = packed_params(model)
    if hasattr(model, "init_std"):
        adapters = {n for n, _ in _adapters(model)}
        for name, p in model.named_parameters():
            if name in adapters:
                continue  # their own init below, as PEFT draws it (B zeros)
            std = model.init_std(name)
            full = torch.empty(p.shape, dtype=p.dtype)
            if std is None:
                full.fill_(1.0)
            else:
                full.normal_(0.0, std, generator=torch.Generator().manual_seed(
                    param_seed(seed, name)))
            _assign(p, full.to(p.device if not isinstance(p, DTensor) else "cpu"), packed.get(name))
        init_adapters(model, seed)
        return "init_std"
    _reset_each(model, seed, model.named_modules(), packed)
    wanted, paths = _to_initialize(model, spec)
    if not wanted:
        return "reset_parameters"
    if spec is None:
        raise ValueError(f"{_listed(wanted)} have no reset_parameters(): init_weights needs the "
                         "model's spec to replay its constructor")

    got: set[tuple[str, str]] = set()

    def take(path: str, name: str, full: torch.Tensor) -> None:  # a later value replaces
        if name in wanted.get(path, ()):
            p = own_parameters(model.get_submodule(path))[name]
            _assign(p, full if isinstance(p, DTensor) else full.to(p.device),
                    packed.get(f"{path}.{name}" if path else name))
            got.add((path, name))
    problems = replay_constructors(spec, seed, take, build_model, paths)
    left = {path: [n for n in names if (path, n) not in got] for path, names in wanted.items()}
    left = {path: names for path, names in left.items() if names}
    if problems or left:
        raise ValueError("; ".join(problems + ([f"{_listed(left)} not written by the replayed "
                                                f"constructor"] if left else [])))
    return "reset_parameters and constructor"


def _to_initialize(model: nn.Module, spec: ModelSpec | None) -> tuple[dict[str, list[str]], list | None]:
    """{module path: parameter names} of ``model`` that only its constructor's replay sets:
    those of modules without ``reset_parameters()``, and those written (or set anew) after
    their module was complete, which one meta build of ``spec`` finds; with that build's
    module paths for the replay (None: no build made, no ``spec`` or an ``init_std`` model)."""
    wanted = constructor_modules(model)
    if spec is None or hasattr(model, "init_std"):
        return wanted, None
    paths, late = watch_build(spec, build_model)
    modules = dict(model.named_modules(remove_duplicate=False))  # a pipeline part: its own
    for path, names in late.items():
        own = own_parameters(modules[path]) if path in modules else {}
        for name in names:
            if own.get(name) is not None and name not in wanted.get(path, []):
                wanted.setdefault(path, []).append(name)
    return wanted, paths


def _listed(modules: dict[str, list[str]]) -> str:
    names = [f"{path}.{n}" if path else n for path, ns in modules.items() for n in ns]
    return ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")


def constructor_problems(spec: ModelSpec, model: nn.Module, seed: int) -> list[str]:
    """Why some parameters of ``model`` (built from ``spec`` on meta) could not be initialized
    as the user's constructor writes them: each parameter named, with the fix. Replays the
    constructor on CPU (one module's tensors at a time) when the model has modules without
    ``reset_parameters`` or parameters written after their module was complete (a meta build
    finds them); nothing more to do for the others."""
    wanted, paths = _to_initialize(model, spec)
    if not wanted:
        return []
    got: set[str] = set()
    problems = replay_constructors(spec, seed, lambda path, n, t: got.add(f"{path}.{n}" if path else n),
                                   build_model, paths)
    said = " ".join(problems)
    names = [f"{p}.{n}" if p else n for p, ns in wanted.items() for n in ns]
    missed = [name for name in names if name not in got and f"'{name}'" not in said]
    if missed:
        problems.append(f"{', '.join(missed[:6])}{' ...' if len(missed) > 6 else ''}: not set by "
                        "the constructor of the module holding it")
    fix = ("give the module a reset_parameters() that sets its parameters, or set them in its "
           "own __init__, or write them whole afterwards (nn.init.normal_, copy_) rather than "
           "change what they hold (tpplan reruns the model's constructor under train.seed and "
           "takes each module's parameters when the module is complete; docs/training.md)")
    return [f"{p}; {fix}" for p in dict.fromkeys(problems)]


def _adapters(model: nn.Module):
    """(parameter name, module path) of LoRA adapters (``tpplan.parallel.lora.adapters``)."""
    return [(f"{path}.{n}", path) for path, m in model.named_modules()
            if getattr(m, "is_lora_adapter", False) for n, _ in m.named_parameters(recurse=False)]


def init_adapters(model: nn.Module, seed: int) -> int:
    """(Re)draw the LoRA adapters alone, each seeded by its path (after pretrained weights
    filled the base); returns how many adapter modules."""
    paths = {path for _, path in _adapters(model)}
    _reset_each(model, seed, [(p, model.get_submodule(p)) for p in sorted(paths)], {})
    return len(paths)


def _reset_each(model: nn.Module, seed: int, modules, packed: dict) -> None:
    for path, module in modules:
        own = dict(module.named_parameters(recurse=False))
        if not own or not hasattr(module, "reset_parameters"):
            continue
        copy = _cpu_copy(module)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(param_seed(seed, path))
            copy.reset_parameters()
        for pname, p in own.items():
            _assign(p, getattr(copy, pname).detach(),
                    packed.get(f"{path}.{pname}" if path else pname))


def _cpu_copy(module: nn.Module) -> nn.Module:
    """A CPU module of the same class and shapes as ``module`` (whose params may be DTensors)."""
    clone = shell_copy(module)  # no constructor run, the None entries reset_parameters reads kept
    set_parameters(clone, {name: nn.Parameter(torch.empty(p.shape, dtype=p.dtype))
                           for name, p in module.named_parameters(recurse=False)})
    return clone
