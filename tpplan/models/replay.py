"""Parameters set in a constructor, as the user's code writes them: the whole model's
construction replayed on CPU under the run's seed, one module's tensors kept at a time.

A module that owns parameters and has no ``reset_parameters()`` (grouped experts written as
``nn.Parameter(torch.randn(E, d, h) * 0.02)``, a hand-written norm's ``torch.ones(d)``) has
no way to be initialized again except its constructor. Rerunning one module's constructor
alone would draw different numbers from the ones ``torch.manual_seed(seed); Model(cfg)``
gives: the random state it starts from depends on everything built before it. So the whole
model's constructor is replayed, in its own order, under ``torch.manual_seed(seed)``:

- a parameter of a module with ``reset_parameters()`` goes to the meta device as soon as it
  is registered (tpplan initializes it by that method); the random numbers its constructor
  then draws on it (``nn.Linear``'s kaiming init) are drawn on a scratch CPU tensor and
  dropped, so the random stream advances exactly as in the plain build;
- a module without it keeps its CPU parameters until it is complete -- registered into its
  parent, or the factory returned -- when they are handed over (``take``) and dropped too.

Peak extra memory is one module's tensors (and whatever the constructor itself holds), never
the model. The numbers equal the plain CPU build's at every mesh shape. What cannot be
replayed is returned by :func:`replay_constructors`: a parameter changed by other code after its
module was complete (a parent writing into a child's weight), a factory whose modules are
not the same from one build to the next.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.nn.modules.module import (register_module_module_registration_hook,
                                     register_module_parameter_registration_hook)

from .._torch.dispatch import TorchDispatchMode, op_schema
from .._torch.modules import own_parameters, set_parameters
from ..plan.specs import ModelSpec

__all__ = ["constructor_modules", "replay_constructors"]

Take = Callable[[str, str, torch.Tensor], None]


def constructor_modules(model: nn.Module) -> dict[str, list[str]]:
    """{module path: its own parameter names} of the modules only a constructor can
    initialize (own parameters, no ``reset_parameters``); empty when the model has
    ``init_std`` (every parameter drawn by it)."""
    if hasattr(model, "init_std"):
        return {}
    return {path: [n for n, p in own_parameters(m).items() if p is not None]
            for path, m in model.named_modules()
            if not hasattr(m, "reset_parameters") and any(p is not None for p in own_parameters(m).values())}


class _Replay(TorchDispatchMode):
    """Random draws on meta tensors made on scratch CPU tensors (the stream advances as in the
    plain build); a write into a handed-over parameter recorded as a problem."""

    def __init__(self, done: dict[int, tuple], problems: list[str]):
        super().__init__()
        self.done, self.problems = done, problems

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = op_schema(func)
        written = [a for a, arg in zip(args, schema.arguments)
                   if arg.alias_info is not None and arg.alias_info.is_write]
        for t in written:
            if isinstance(t, torch.Tensor) and id(t) in self.done:
                self.problems.append(f"{self.done[id(t)][1]} is changed after its module was "
                                     f"complete (by {func}), by code outside the module's own "
                                     f"constructor")
        if torch.Tag.nondeterministic_seeded in func.tags and (
                any(isinstance(a, torch.Tensor) and a.is_meta for a in args) or
                str(kwargs.get("device", "")) == "meta"):
            def cpu(x):
                if isinstance(x, torch.Tensor) and x.is_meta:
                    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype)
                return x
            func(*[cpu(a) for a in args],
                 **{k: ("cpu" if k == "device" else cpu(v)) for k, v in kwargs.items()})
        return func(*args, **kwargs)


def _structure(spec: ModelSpec, build) -> list[str | None]:
    """The model path of each module registration, in the order the constructor makes them,
    from a meta build (no numbers)."""
    events: list[nn.Module] = []
    handle = register_module_module_registration_hook(
        lambda parent, name, child: events.append(child) if child is not None else None)
    try:
        with torch.random.fork_rng(devices=[]):  # a constructor drawing on CPU leaves no trace
            model = build(spec, "meta")
    finally:
        handle.remove()
    path_of: dict[int, str] = {}
    for path, m in model.named_modules(remove_duplicate=False):
        path_of.setdefault(id(m), path)
    return [path_of.get(id(c)) for c in events]


def replay_constructors(spec: ModelSpec, seed: int, take: Take, build) -> list[str]:
    """Replay ``build(spec, "cpu")`` under ``torch.manual_seed(seed)`` (the caller's random
    state restored after), handing each module's constructor-written parameters to
    ``take(module path, name, CPU tensor)`` when the module is complete; returns the
    problems that keep the numbers from being the plain build's (empty: none)."""
    paths = _structure(spec, build)
    problems: list[str] = []
    done: dict[int, tuple] = {}  # id of a handed-over (now meta) parameter -> it, its path
    count = [0]

    def hand_over(module: nn.Module, where: Callable[[], str | None]) -> None:
        kept = {n: p for n, p in own_parameters(module).items() if p is not None and not p.is_meta}
        path = where() if kept else None
        for name, p in kept.items():
            if path is not None:
                take(path, name, p.detach())
            meta = nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
            set_parameters(module, {name: meta})
            done[id(meta)] = (meta, f"parameter '{path + '.' if path else ''}{name}'")  # held: ids stay unique

    def on_param(module, name, param):
        if param is not None and hasattr(module, "reset_parameters") and not param.is_meta:
            return nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        if param is not None and param.is_meta and not hasattr(module, "reset_parameters"):
            problems.append(f"parameter '{name}' of a {type(module).__name__} is computed from "
                            "another module's parameter after that module was complete")
        return None

    def on_module(parent, name, child):
        if child is None:
            return None
        k, count[0] = count[0], count[0] + 1
        if k >= len(paths):
            problems.append("the factory built more modules than on the meta device: its "
                            "modules differ from one build to the next")
            return None
        for sub in child.modules():  # a child complete: everything under it is
            hand_over(sub, lambda sub=sub: None if paths[k] is None else _below(child, sub, paths[k]))
        return None

    hooks = [register_module_parameter_registration_hook(on_param),
             register_module_module_registration_hook(on_module)]
    try:
        with torch.random.fork_rng(devices=[]), _Replay(done, problems):
            torch.manual_seed(seed)
            model = build(spec, "cpu")
    finally:
        for h in hooks:
            h.remove()
    if count[0] != len(paths):
        problems.append(f"the factory built {count[0]} modules on CPU and {len(paths)} on the "
                        "meta device: its modules differ from one build to the next")
    for path, m in model.named_modules():
        hand_over(m, lambda path=path: path)  # the root and anything registered late
    return problems


def _below(parent: nn.Module, sub: nn.Module, parent_path: str) -> str | None:
    if sub is parent:
        return parent_path
    for rel, m in parent.named_modules():
        if m is sub:
            return f"{parent_path}.{rel}" if parent_path else rel
    return None
