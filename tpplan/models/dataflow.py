"""Record which module hands which tensor to which: one forward, hooks on every module.

``tpplan suggest`` reads a model's dataflow from this instead of from its names. The forward
runs on the meta device when the model allows it (no memory at any size); HuggingFace models
whose mask code reads tensor values run on a shrunk CPU copy of the same architecture.
"""

from __future__ import annotations

import re

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from .._torch.dispatch import torch_function_disabled

__all__ = ["Call", "Trace", "trace_forward"]


def _tensor_ids(value: Any) -> list[int]:
    if isinstance(value, torch.Tensor):
        return [id(value)]
    if isinstance(value, (list, tuple)):
        return [i for v in value for i in _tensor_ids(v)]
    if isinstance(value, dict):
        return [i for v in value.values() for i in _tensor_ids(v)]
    if hasattr(value, "logits"):  # HF ModelOutput
        return _tensor_ids(value.logits)
    return []


_INPLACE = re.compile(r"^(?!_)\w+_$|^__i(add|sub|mul|truediv|div|floordiv|mod|pow|matmul|and|or|"
                      r"xor|lshift|rshift)__$|^__setitem__$")


def _quiet(hook):
    """A trace hook's own tensor accesses (``a.shape``) are not the model's code."""
    def run(*args):
        with torch_function_disabled():
            return hook(*args)
    return run


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


@dataclass
class Call:
    """One module call: positional inputs, keyword inputs and output, as tensor ids."""

    path: str
    module: nn.Module
    args: list[int | None]  # per positional argument: the tensor's id, None if not a tensor
    kwargs: dict[str, int]  # keyword arguments that are tensors
    outputs: list[int] = field(default_factory=list)
    shapes: dict[int, tuple] = field(default_factory=dict)  # id -> shape
    arity: int = 1  # entries of a tuple output (attention's (output, weights))

    @property
    def inputs(self) -> list[int]:
        return [a for a in self.args if a is not None] + list(self.kwargs.values())


@dataclass
class Trace:
    calls: list[Call]
    # tensor id -> paths of the modules whose own code (not a child module) reads it: a
    # post-norm block adds its norm's output to the residual stream (MiniMax)
    code_reads: dict[int, set[str]] = field(default_factory=dict)
    # every torch function the forward ran: (innermost module's path, input ids, output ids),
    # and each tensor's shape
    ops: list[tuple[str, list[int], list[int]]] = field(default_factory=list)
    shapes: dict[int, tuple] = field(default_factory=dict)
    # tensor id -> path of the module whose code modified it in place (Llama 4's ``out.add_``)
    modified: dict[int, str] = field(default_factory=dict)

    def within(self, prefix: str) -> list[Call]:
        return [c for c in self.calls if c.path.startswith(prefix + ".")]

    def consumers(self, tensor_id: int) -> list[Call]:
        return [c for c in self.calls if tensor_id in c.inputs]

    def first_call(self, path: str) -> Call | None:
        return next((c for c in self.calls if c.path == path), None)


def trace_forward(model: nn.Module, tokens: torch.Tensor) -> Trace:
    """Run ``model(tokens)`` once, recording every module call in order."""
    calls: list[Call] = []
    keep: list[Any] = []  # hold every tensor so ids stay unique while we look at them
    stack: list[Call] = []
    handles = []

    def pre(path):
        @_quiet
        def hook(module, args, kwargs):
            keep.append((args, kwargs))
            call = Call(path, module,
                        [id(a) if isinstance(a, torch.Tensor) else None for a in args],
                        {k: id(v) for k, v in kwargs.items() if isinstance(v, torch.Tensor)})
            for a in list(args) + list(kwargs.values()):
                if isinstance(a, torch.Tensor):
                    call.shapes[id(a)] = tuple(a.shape)
            calls.append(call)
            stack.append(call)
        return hook

    @_quiet
    def post(module, args, kwargs, output):
        keep.append(output)
        call = stack.pop()
        call.outputs = _tensor_ids(output)
        call.arity = len(output) if isinstance(output, tuple) else 1
        if isinstance(output, torch.Tensor):
            call.shapes[id(output)] = tuple(output.shape)

    for path, module in model.named_modules():
        if not path:
            continue
        handles.append(module.register_forward_pre_hook(pre(path), with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True))
    code_reads: dict[int, set[str]] = {}
    modified: dict[int, str] = {}
    ops: list[tuple[str, list[int], list[int]]] = []
    shapes: dict[int, tuple] = {}

    def note(value: Any) -> list[int]:
        keep.append(value)
        for t in _tensors(value):
            shapes[id(t)] = tuple(t.shape)
        return _tensor_ids(value)

    class _Reads(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if stack and getattr(func, "__name__", "") != "__get__":  # x.shape: no data read
                ins = note([args, kwargs or {}])
                for i in ins:
                    code_reads.setdefault(i, set()).add(stack[-1].path)
                ops.append((stack[-1].path, ins, note(out)))
                name = getattr(func, "__name__", "")
                if ins and _INPLACE.match(name) and name != "requires_grad_":
                    modified.setdefault(ins[0], stack[-1].path)  # add_, +=, x[i] = y
            return out

    try:
        with torch.no_grad(), _Reads():
            model(tokens)
    finally:
        for h in handles:
            h.remove()
    return Trace(calls, code_reads, ops, shapes, modified)
