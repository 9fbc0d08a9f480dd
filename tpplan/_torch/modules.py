"""A module's own parameters, children and buffers: read, swapped for a call, or replaced.

Relies on ``nn.Module`` keeping its own parameters, children and buffers in the plain dicts
``_parameters``, ``_modules`` and ``_buffers`` (name -> value, ``None`` for an entry
registered empty, in registration order), which ``named_parameters``, ``children``,
``state_dict`` and ``__getattr__`` all read: checked on torch 2.11 through 2.14.1. Writing an
entry directly skips ``register_parameter``'s checks, so a plain tensor can stand in for a
parameter for the length of a call (a DTensor parameter's local shard, the local experts'
views), which is what tensor and expert parallelism's forwards need.

Names may be dotted (``"experts.5.w1.weight"``, ``"model.layers"``): the entry goes to the
submodule that owns it, as ``nn.Module.get_parameter`` resolves them.

Example::

    >>> with swapped(linear, parameters={"weight": linear.weight.to_local()}):
    ...     out = linear(x)                     # the local shard, put back even if it raises
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.nn as nn

__all__ = ["own_buffers", "own_children", "own_parameters", "set_buffers", "set_children",
           "set_parameters", "shell_copy", "swap_around_forward", "swapped"]

_MISSING = object()


def own_parameters(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """A copy of ``module``'s own parameter entries, in order, ``None`` entries included (an
    ``nn.Linear(bias=False)``'s ``bias``); ``named_parameters`` drops those and duplicates."""
    return dict(module._parameters)


def own_children(module: nn.Module) -> dict[str, nn.Module | None]:
    """A copy of ``module``'s child entries, in order, ``None`` entries included."""
    return dict(module._modules)


def own_buffers(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """A copy of ``module``'s own buffer entries, in order, ``None`` entries included."""
    return dict(module._buffers)


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (module.get_submodule(path) if path else module), leaf


def _write(module: nn.Module, kind: str, mapping: Mapping[str, Any],
           undo: list[tuple[dict, str, Any]] | None = None) -> None:
    """Write each entry of ``mapping`` into its owner's ``kind`` dict, in order (an owner is
    resolved after the entries before it are written), noting in ``undo`` what to put back
    as each is written (so a failure halfway puts back what was written)."""
    undo = [] if undo is None else undo
    for name, value in mapping.items():
        owner, leaf = _owner(module, name)
        entries = getattr(owner, kind)  # the instance's own dict
        undo.append((entries, leaf, entries.get(leaf, _MISSING)))
        entries[leaf] = value


def _put_back(undo: list[tuple[dict, str, Any]]) -> None:
    for entries, leaf, old in reversed(undo):
        if old is _MISSING:
            entries.pop(leaf, None)
        else:
            entries[leaf] = old  # an existing key keeps its place in the order


@contextlib.contextmanager
def swapped(module: nn.Module, *, parameters: Mapping[str, torch.Tensor | None] | None = None,
            children: Mapping[str, nn.Module | None] | None = None,
            all_children: bool = False) -> Iterator[nn.Module]:
    """``module`` with the given entries in place of its own for the ``with`` block, the
    originals put back on leaving, also when the block raises.

    Keyword Args:
        parameters (mapping, optional): parameter name (dotted: a submodule's) -> the tensor
            (any tensor, or None) the module reads under that name meanwhile. Default None.
        children (mapping, optional): child name (dotted) -> module (or None). Default None.
        all_children (bool): ``children`` (plain names) are all of ``module``'s children
            meanwhile, in that order (a list of experts seen from index 0); its own dict of
            children is set aside whole and put back. Default False.

    Example::

        >>> with swapped(parent, children={"layers": first_two}):
        ...     copy = deepcopy(parent)
    """
    undo: list[tuple[dict, str, Any]] = []
    held = module.__dict__["_modules"] if all_children else None
    try:
        if all_children:
            module.__dict__["_modules"] = dict(children or {})
        elif children:
            _write(module, "_modules", children, undo)
        if parameters:
            _write(module, "_parameters", parameters, undo)
        yield module
    finally:
        _put_back(undo)
        if held is not None:
            module.__dict__["_modules"] = held


def swap_around_forward(module: nn.Module,
                        parameters: Callable[[nn.Module], Mapping[str, torch.Tensor | None]]) -> None:
    """Around every forward of ``module``: ``parameters(module)`` swapped in (as
    :func:`swapped`'s ``parameters``) by a forward pre-hook, computed when the call starts
    (FSDP2's pre-hook, which runs first, has set its unsharded parameters by then), and put
    back by a forward hook registered with ``always_call=True``, so also when the forward
    or a later pre-hook raises. The swaps of nested calls are a stack (a module re-entered)."""
    held: list[list[tuple[dict, str, Any]]] = []

    def swap_in(mod: nn.Module, args: Any) -> None:
        undo: list[tuple[dict, str, Any]] = []
        held.append(undo)  # before writing: a failure halfway is put back too
        _write(mod, "_parameters", parameters(mod), undo)

    def put_back(mod: nn.Module, args: Any, out: Any) -> None:
        if held:  # empty when a pre-hook before ours raised
            _put_back(held.pop())

    module.register_forward_pre_hook(swap_in)
    module.register_forward_hook(put_back, always_call=True)


def set_parameters(module: nn.Module, mapping: Mapping[str, torch.Tensor | None]) -> None:
    """Each entry of ``mapping`` (name, dotted for a submodule's -> tensor) becomes that
    parameter for good, written directly: no ``register_parameter`` checks or hooks (a
    weight shared again after each owner got its own copy, an expert's new shard)."""
    _write(module, "_parameters", mapping)


def set_buffers(module: nn.Module, mapping: Mapping[str, torch.Tensor | None]) -> None:
    """Each entry of ``mapping`` (name, dotted -> tensor) becomes that buffer for good,
    written directly (its persistence unchanged)."""
    _write(module, "_buffers", mapping)


def set_children(module: nn.Module, mapping: Mapping[str, nn.Module | None]) -> None:
    """``module``'s children become exactly ``mapping`` (plain names), in its order, for
    good, in a dict of their own: a shallow copy of a module stops sharing its original's."""
    module.__dict__["_modules"] = dict(mapping)


def shell_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` without its parameters or children: same class, same attributes,
    its buffers (a dict of its own), its ``None`` parameter entries (which code such as
    ``reset_parameters`` reads), no constructor run: FSDP2's module classes construct
    themselves again in ``__new__``, which ``copy.copy`` would call without arguments."""
    clone = object.__new__(type(module))
    clone.__dict__ = dict(module.__dict__)
    clone.__dict__["_parameters"] = {name: None for name, p in module._parameters.items() if p is None}
    clone.__dict__["_modules"] = {}
    clone.__dict__["_buffers"] = dict(module._buffers)
    return clone
