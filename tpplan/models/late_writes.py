"""Writes a constructor makes into a parameter after the parameter's module is complete.

The commonest way to write a model (nanoGPT, minGPT, HF's ``_init_weights``) builds its
``nn.Linear`` and ``nn.Embedding`` layers, then writes their weights again from the parent:
``self.apply(self._init_weights)`` with ``nn.init.normal_(module.weight, 0.0, 0.02)`` or
``module.weight.data.normal_(...)``, then a loop over ``named_parameters`` rescaling some.
Those modules have ``reset_parameters()``, yet what the user's model starts from is what the
parent wrote. This module finds such writes: :func:`watch_build` builds the model once with
its parameters on the meta device (no numbers) under a dispatch mode that notes every
in-place write into a parameter whose module is complete -- registered into its parent --
identifying the parameter by its storage, so a write through ``.data`` or a view is seen
too; :class:`Completion` is that bookkeeping, shared with the CPU replay (:mod:`.replay`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import (register_module_module_registration_hook,
                                     register_module_parameter_registration_hook)

from .._torch.dispatch import TorchDispatchMode, op_packet, op_schema
from .._torch.modules import own_parameters
from .._torch.nn import initializers_seen
from .._torch.storage import storage_key
from ..plan.specs import ModelSpec

__all__ = ["Completion", "overwrites", "watch_build", "written_tensors"]

# In-place operators whose result does not depend on what their target held: a write by one
# of them over a whole parameter needs no earlier value of it.
_OVERWRITES = frozenset({"normal_", "uniform_", "fill_", "zero_", "random_", "exponential_",
                         "bernoulli_", "log_normal_", "cauchy_", "geometric_", "copy_"})



def written_tensors(func: Any, args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
    """(argument name, tensor) of each tensor ``func`` writes in place (its schema says so:
    ``self`` of ``normal_``, ``out`` of an ``.out`` overload)."""
    found = []
    for i, arg in enumerate(op_schema(func).arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        for t in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(t, torch.Tensor):
                found.append((arg.name, t))
    return found


def overwrites(func: Any, argument: str, target: torch.Tensor, whole: torch.Tensor) -> bool:
    """Whether writing ``target`` (a view of ``whole``'s storage) by ``func`` sets every element
    of ``whole`` without reading any: an ``out=`` argument, or an operator of ``_OVERWRITES``
    on a view covering the same elements (``.data``, ``.t()``, a reshape)."""
    if argument != "out" and str(op_packet(func)).rpartition(".")[2] not in _OVERWRITES:
        return False
    if target.numel() != whole.numel() or target.storage_offset() != whole.storage_offset():
        return False
    span = sum((n - 1) * s for n, s in zip(target.shape, target.stride()))
    return all(s >= 0 for s in target.stride()) and span == whole.numel() - 1


class Completion:
    """Which modules are complete (registered into their parent) and, for each storage of a
    meta parameter of theirs, that parameter and its owners ``[(module, name)]`` (several for
    a tied weight). Modules and parameters are held, so their ids and keys stay unique."""

    def __init__(self) -> None:
        self.modules: dict[int, nn.Module] = {}
        self.owners: dict[int, tuple[torch.Tensor, list[tuple[nn.Module, str]]]] = {}
        self._pending: list[tuple[nn.Module, str]] = []

    def complete(self, child: nn.Module) -> None:
        """``child`` was registered into its parent: it and everything under it is complete."""
        for sub in child.modules():
            if id(sub) not in self.modules:
                self.modules[id(sub)] = sub
                self._pending += [(sub, n) for n, p in own_parameters(sub).items() if p is not None]

    def registered(self, module: nn.Module, name: str) -> bool:
        """A parameter registered into ``module``; whether ``module`` is complete. (Its owner
        is read later: a registration hook runs before the parameter is put on meta.)"""
        if id(module) not in self.modules:
            return False
        self._pending.append((module, name))
        return True

    def owner(self, t: torch.Tensor) -> tuple[torch.Tensor, list[tuple[nn.Module, str]]] | None:
        """The meta parameter whose storage ``t`` views and its owners, if its module is
        complete; else None."""
        for module, name in self._pending:
            p = own_parameters(module).get(name)
            if p is not None and p.is_meta:
                owners = self.owners.setdefault(storage_key(p), (p, []))[1]
                if not any(m is module and n == name for m, n in owners):
                    owners.append((module, name))
        self._pending.clear()
        return self.owners.get(storage_key(t)) if t.is_meta else None


class _Watch(TorchDispatchMode):
    """Notes the storage of each parameter of a complete module that an operator writes."""

    def __init__(self, completion: Completion, written: dict[int, torch.UntypedStorage]):
        super().__init__()
        self.completion, self.written = completion, written

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for _, t in written_tensors(func, args, kwargs):
            if t.is_meta and self.completion.owner(t):
                self.written[storage_key(t)] = t.untyped_storage()
        return func(*args, **kwargs)


def watch_build(spec: ModelSpec, build) -> tuple[list[str | None], dict[str, list[str]]]:
    """One build of ``spec`` with its parameters on meta (``build(spec, "meta",
    real_buffers=True)``, the caller's random state untouched): the model path of each module
    registration in the constructor's order (None: not in the model), and {module path:
    parameter names} written -- or set anew -- after their module was complete."""
    events: list[nn.Module] = []
    completion, written = Completion(), {}
    set_late: list[tuple[nn.Module, str]] = []

    def on_module(parent, name, child):
        if child is not None:
            events.append(child)
            completion.complete(child)

    def on_param(module, name, param):
        if param is not None and not param.is_meta and completion.registered(module, name):
            set_late.append((module, name))  # a new value; a tie re-registers a meta one

    hooks = [register_module_module_registration_hook(on_module),
             register_module_parameter_registration_hook(on_param)]
    try:
        with torch.random.fork_rng(devices=[]), initializers_seen(False), _Watch(completion, written):
            model = build(spec, "meta", real_buffers=True)
    finally:
        for h in hooks:
            h.remove()
    for module, name in set_late:
        if (p := own_parameters(module).get(name)) is not None:
            written[storage_key(p)] = p.untyped_storage()
    path_of: dict[int, str] = {}
    late: dict[str, list[str]] = {}
    for path, m in model.named_modules(remove_duplicate=False):
        path_of.setdefault(id(m), path)
        for n, p in own_parameters(m).items():
            if p is not None and storage_key(p) in written and n not in late.get(path, []):
                late.setdefault(path, []).append(n)
    return [path_of.get(id(c)) for c in events], late
