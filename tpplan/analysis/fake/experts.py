"""Data-dependent operators inside an experts module, sized under balanced routing.

A user's experts pick each expert's rows the ordinary way (``torch.where(idx == e)``, a
boolean index, ``bincount`` of the ids and ``.tolist()`` of the counts, as transformers'
eager experts and most hand-written MoEs do). Each of those has an output whose size is a
value, which fake and meta tensors do not have, so the dry run's trace would stop there
(``DynamicOutputShapeException: aten.nonzero.default``). Under the dry run's stated
assumption, balanced routing (the one ``expert_parallel``'s dispatch is traced under,
:func:`~tpplan.parallel.experts.style.balanced_routing`), each of the ``E`` experts a module
holds gets an even share of what it is handed, so inside an experts module:

- ``nonzero`` (``torch.where`` with one argument, a boolean index) of ``n`` elements finds
  ``ceil(n / E)`` of them;
- ``bincount``/``masked_select`` return ``max(minlength, E)`` counts / ``ceil(n / E)``
  elements, and a count read back (``.item()``, ``.tolist()``) is the last balanced share.

Outside an experts module nothing changes; an operator that cannot be sized so raises its
error naming the operator and the module. What was sized is recorded (:func:`sized`), for
the report to say so.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from typing import Iterator

import torch
import torch.nn as nn

from ..._torch.dispatch import TorchDispatchMode
from ..._torch.ops import LOCAL_SCALAR_DENSE, TO_COPY
from ...parallel.experts.forms import expert_count

__all__ = ["balanced_experts", "sized"]

aten = torch.ops.aten
_SIZED: dict[str, set[str]] = {}  # experts module class -> operators sized, this dry run
_KIND: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


def sized() -> dict[str, list[str]]:
    """The experts modules (by class) whose data-dependent operators this dry run sized
    under balanced routing, and those operators."""
    return {k: sorted(v) for k, v in sorted(_SIZED.items())}


def _is_experts(module: nn.Module) -> bool:
    if module not in _KIND:
        experts = getattr(module, "experts", None)
        _KIND[module] = expert_count(module) is not None or (
            isinstance(experts, nn.ModuleList) and expert_count(experts) is not None)
    return _KIND[module]


def _held(module: nn.Module) -> int:
    """The experts ``module`` holds now (under expert_parallel: this rank's)."""
    if isinstance(module, nn.ModuleList):
        return len(module)
    experts = getattr(module, "experts", None)
    if isinstance(experts, nn.ModuleList):
        return len(experts)
    for p in module.parameters(recurse=False):
        if p.dim() >= 3:
            local = p.to_local() if hasattr(p, "to_local") else p
            return max(1, local.shape[0])
    return max(1, getattr(module, "num_experts", 1))


class _Balanced(TorchDispatchMode):
    """Inside one experts module's forward: the data-dependent operators given balanced
    sizes (the module docstring's rules), every other operator run as it is."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module, self.share = module, None

    def _note(self, func) -> None:
        _SIZED.setdefault(type(self.module).__name__, set()).add(func.__name__.split(".")[0])

    def _nonzero(self, mask: torch.Tensor) -> torch.Tensor:
        n = mask.numel()
        self.share = min(n, math.ceil(n / _held(self.module)))
        return torch.zeros((self.share, mask.dim()), dtype=torch.long, device=mask.device)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.nonzero.default, aten.argwhere.default):
            self._note(aten.nonzero.default)
            return self._nonzero(args[0])
        if func is aten.index.Tensor and any(
                i is not None and i.dtype is torch.bool for i in args[1]):
            self._note(func)
            indices = []
            for i in args[1]:
                if i is not None and i.dtype is torch.bool:
                    indices += list(self._nonzero(i).unbind(1))
                else:
                    indices.append(i)
            return func(args[0], indices)
        if func is aten.masked_select.default:
            self._note(func)
            n = torch.broadcast_shapes(args[0].shape, args[1].shape).numel()
            self.share = min(n, math.ceil(n / _held(self.module)))
            return args[0].new_empty((self.share,))
        if func is aten.bincount.default:
            self._note(func)
            length = max(kwargs.get("minlength", args[2] if len(args) > 2 else 0),
                         getattr(self.module, "num_experts", 0), _held(self.module))
            self.share = math.ceil(args[0].numel() / length)
            dtype = torch.long if (args[1] if len(args) > 1 else kwargs.get("weights")) is None \
                else torch.double
            return torch.full((length,), self.share, dtype=dtype, device=args[0].device)
        if func is LOCAL_SCALAR_DENSE:
            self._note(func)
            return self._scalar(args[0])
        if func is TO_COPY and args[0].device.type == "meta" \
                and torch.device(kwargs.get("device") or "meta").type != "meta":
            self._note(func)  # .tolist() of a meta tensor: its values, as one copy
            return torch.full(args[0].shape, self._scalar(args[0]),
                              dtype=kwargs.get("dtype") or args[0].dtype, device=kwargs["device"])
        try:
            return func(*args, **kwargs)
        except Exception as e:
            if type(e).__name__ not in ("DynamicOutputShapeException", "DataDependentOutputException"):
                raise
            raise NotImplementedError(
                f"the dry run cannot size {func} inside experts module {type(self.module).__name__}: "
                "its output's size is data that balanced routing does not give") from e

    def _scalar(self, t: torch.Tensor):
        if t.dtype.is_floating_point or t.dtype is torch.bool:
            raise NotImplementedError(
                f"the dry run cannot size .item() of a {t.dtype} tensor inside experts module "
                f"{type(self.module).__name__}: its value is data, not a count balanced routing gives")
        return self.share if self.share is not None else math.ceil(t.numel() / _held(self.module))


_STACK: list[_Balanced] = []


def _enter(module, args, kwargs=None):
    if _is_experts(module):
        mode = _Balanced(module)
        mode.__enter__()
        _STACK.append(mode)


def _leave(module, args, output, kwargs=None):
    if _STACK and _STACK[-1].module is module:
        _STACK.pop().__exit__(None, None, None)


@contextlib.contextmanager
def balanced_experts() -> Iterator[None]:
    """Within the block, every experts module's forward (a module :func:`expert_count`
    recognises, or one whose ``experts`` list it does) runs with its data-dependent
    operators sized under balanced routing."""
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    _SIZED.clear()
    hooks = [register_module_forward_pre_hook(_enter),
             register_module_forward_hook(_leave, always_call=True)]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        while _STACK:
            _STACK.pop().__exit__(None, None, None)
