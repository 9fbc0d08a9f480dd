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
  parent, or the factory returned -- when they are handed over (``take``) and dropped too;
- a write into a parameter after its module is complete (a parent's
  ``apply(_init_weights)``, a loop over ``named_parameters``, through ``.data`` or a view:
  found by storage, :mod:`.late_writes`) is computed on a CPU shadow of that one parameter,
  created by a write that sets it whole and handed over when the constructor writes another
  parameter or returns (a later value replaces an earlier one).

Peak extra memory is one module's tensors or one parameter's shadow (and whatever the
constructor itself holds), never the model. The numbers equal the plain CPU build's at every
mesh shape. What cannot be replayed is returned by :func:`replay_constructors`: a parameter
changed after its module was complete by a write that reads what it held before (``mul_``)
with no shadow of it alive (its first such write, or one after the constructor moved on to
other parameters), or one written from a value not kept (another parameter); a factory whose
modules are not the same from one build to the next.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.nn.modules.module import (register_module_module_registration_hook,
                                     register_module_parameter_registration_hook)

from .._torch.dispatch import TorchDispatchMode
from .._torch.modules import own_parameters, set_parameters
from .._torch.storage import storage_key
from ..plan.specs import ModelSpec
from .._torch.nn import initializers_seen
from .late_writes import Completion, overwrites, watch_build, written_tensors

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


def _said(names: list[tuple[str, str]]) -> str:
    return ", ".join(f"'{path}.{n}'" if path else f"'{n}'" for path, n in names)


class _Shadow:
    """The CPU value of the one parameter being written after its module was complete: made
    by a write that sets it whole, handed to ``take`` under each of its names (a tied weight
    has several) when another parameter is written or the build ends, then dropped."""

    def __init__(self, take: Take, problems: list[str]):
        self.take, self.problems = take, problems
        self.key: int | None = None
        self.flat = self.whole = None  # the storage's values on CPU; the meta parameter
        self.names: list[tuple[str, str]] = []

    def release(self) -> None:
        if self.key is not None:
            value = self.flat.as_strided(self.whole.shape, self.whole.stride(), self.whole.storage_offset())
            for path, name in self.names:
                self.take(path, name, value)
        self.key, self.flat, self.whole, self.names = None, None, None, []

    def write(self, func, args: tuple, kwargs: dict, target: torch.Tensor, argument: str,
              whole: torch.Tensor, names: list[tuple[str, str]]) -> None:
        """Run ``func`` with the shadow of ``whole`` in place of ``target`` (a view of it)."""
        if storage_key(target) != self.key:
            self.release()
            if not overwrites(func, argument, target, whole):
                self.problems.append(f"parameter {_said(names)} is changed after its module was "
                                     f"complete (by {func}), by code outside the module's own "
                                     f"constructor")
                return
            elements = target.untyped_storage().nbytes() // whole.element_size()
            self.key, self.whole, self.names = storage_key(target), whole, names
            self.flat = torch.empty(elements, dtype=whole.dtype)
        unknown = []

        def cpu(x):
            if isinstance(x, torch.Tensor) and x.is_meta:
                if storage_key(x) == self.key:
                    return self.flat.as_strided(x.shape, x.stride(), x.storage_offset())
                unknown.append(x)
            return x
        args, kwargs = [cpu(a) for a in args], {k: cpu(v) for k, v in kwargs.items()}
        if unknown:
            self.problems.append(f"parameter {_said(names)} is written after its module was "
                                 f"complete (by {func}) from a value not kept (another "
                                 f"parameter, or a tensor made from one)")
            self.key, self.flat, self.whole, self.names = None, None, None, []
            return
        func(*args, **kwargs)


class _Replay(TorchDispatchMode):
    """Random draws on meta tensors made on scratch CPU tensors (the stream advances as in the
    plain build); a write into a parameter of a complete module made on its shadow."""

    def __init__(self, completion: Completion, shadow: _Shadow,
                 names_of: Callable[[list], list[tuple[str, str]]]):
        super().__init__()
        self.completion, self.shadow, self.names_of = completion, shadow, names_of

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for argument, t in written_tensors(func, args, kwargs):
            found = self.completion.owner(t)
            if found and (names := self.names_of(found[1])):
                self.shadow.write(func, args, kwargs, t, argument, found[0], names)
                return func(*args, **kwargs)
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


def replay_constructors(spec: ModelSpec, seed: int, take: Take, build,
                        paths: list[str | None] | None = None) -> list[str]:
    """Replay ``build(spec, "cpu")`` under ``torch.manual_seed(seed)`` (the caller's random
    state restored after), handing each constructor-written parameter to ``take(module path,
    name, CPU tensor)`` when its module is complete, and each written after that when the
    write is done; returns the problems that keep the numbers from being the plain build's
    (empty: none). ``paths``: :func:`.late_writes.watch_build`'s, when already made."""
    paths = watch_build(spec, build)[0] if paths is None else paths
    problems: list[str] = []
    completion, shadow = Completion(), _Shadow(take, problems)
    path_of: dict[int, str] = {}  # id of a module (held by completion) -> its model path
    count = [0]

    def hand_over(module: nn.Module) -> None:
        path = path_of.get(id(module))
        for name, p in own_parameters(module).items():
            if p is not None and not p.is_meta:
                if path is not None:
                    take(path, name, p.detach())
                set_parameters(module, {name: nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)})

    def on_param(module, name, param):
        if param is None:
            return None
        complete = completion.registered(module, name)
        if not param.is_meta and (complete or hasattr(module, "reset_parameters")):
            if complete and id(module) in path_of:  # set anew after the module was complete
                shadow.release()
                take(path_of[id(module)], name, param.detach())
            return nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        if param.is_meta and not hasattr(module, "reset_parameters"):
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
        if paths[k] is not None:
            for rel, sub in child.named_modules():
                path_of.setdefault(id(sub), f"{paths[k]}.{rel}" if paths[k] and rel else paths[k] or rel)
        for sub in child.modules():  # a child complete: everything under it is
            hand_over(sub)
        completion.complete(child)
        return None

    def names_of(owners: list) -> list[tuple[str, str]]:
        return [(path_of[id(m)], n) for m, n in owners if id(m) in path_of]

    hooks = [register_module_parameter_registration_hook(on_param),
             register_module_module_registration_hook(on_module)]
    try:
        with torch.random.fork_rng(devices=[]), initializers_seen(True), _Replay(completion, shadow, names_of):
            torch.manual_seed(seed)
            model = build(spec, "cpu")
    finally:
        for h in hooks:
            h.remove()
    shadow.release()
    if count[0] != len(paths):
        problems.append(f"the factory built {count[0]} modules on CPU and {len(paths)} on the "
                        "meta device: its modules differ from one build to the next")
    for path, m in model.named_modules():
        path_of.setdefault(id(m), path)
        hand_over(m)  # the root and anything registered late
    return problems
