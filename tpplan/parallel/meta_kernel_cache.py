"""Meta kernels' outputs kept by what they read: the dry run's forwards on meta tensors
(the TP trace, the stage contract, a stage's output shape) call each operator with the same
shapes again and again, block after block and candidate after candidate, and many of
PyTorch's meta kernels are Python (``torch._refs``, ``torch._decomp``: an elementwise op's
type promotion, broadcasting and strides worked out anew each call).

A meta tensor has no values, so a meta kernel's output can depend only on the operator,
its non-tensor arguments, PyTorch's default dtype and each input's metadata: dtype, shape,
strides, storage offset and its conjugate and negative bits (a plain strided
``torch.Tensor`` or ``nn.Parameter``). :data:`META` keys a call by exactly those and, on a
hit, returns new tensors of the kept outputs' dtype, shape and strides, as the kernel
would have made them. It keeps only what that makes exact:

- the operator is ``aten``'s, neither writes nor aliases an argument (no ``Tensor(a)`` in
  its schema: views, in-place and ``out=`` ops always run; one whose output turns out to
  share an input's storage all the same, ``_unsafe_view``, is never kept), and its output
  shape is not data dependent;
- every argument is a meta tensor (as above), a plain value or a list of them, at least
  one a tensor (factories run), and no dispatch mode lies below (a fake mode makes its
  own tensors); any other argument (a DTensor, a fake or CPU tensor, a symbolic size, a
  generator) runs the kernel;
- every output is a meta tensor with storage offset 0, storage of exactly the bytes its
  shape and strides span, its own storage (none shared with an input or another output),
  no conjugate or negative bit (or a plain value such as an int, kept as is).

``tests/test_metacache.py`` holds forwards and backwards with the cache to the same
shapes, strides and dtypes as without it, and the TP trace to the same counts.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from .._torch.dispatch import (Traced, TorchDispatchMode, dispatch_disabled, dispatch_stack_depth,
                               op_schema)
from .._torch.fake import FakeTensor
from .._torch.storage import storage_key

__all__ = ["MetaCache", "META", "MetaCacheMode", "PLAIN", "Unkeyed", "flatten_key", "recipe",
           "remake", "spans"]

PLAIN = frozenset((int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                    torch.memory_format))
_TENSORS = (torch.Tensor, nn.Parameter)
_UNSAFE_TAGS = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output,
                torch.Tag.inplace_view)


class Unkeyed(Exception):
    """An argument (or output) a key does not take."""


def _meta_key(t: torch.Tensor, storages: list | None) -> tuple:
    if t.device.type != "meta" or t.layout is not torch.strided or t.is_conj() or t.is_neg():
        raise Unkeyed
    if storages is not None:
        storages.append(storage_key(t))
    return (t.dtype, tuple(t.shape), t.stride(), t.storage_offset())


def flatten_key(out: list, args, tensors: tuple, key: Callable[[torch.Tensor], tuple]) -> None:
    """Append the key of ``args`` to ``out``: a tensor of a type in ``tensors`` by
    ``key(t)``, a plain value with its type (1 and 1.0 hash alike), a list or tuple by its
    kind and length, then its items; anything else raises :class:`Unkeyed`. (The fake
    mode's cache key, :mod:`tpplan.analysis.fake.tensors`, is built by it too.)"""
    for a in args:
        t = type(a)
        if t in tensors:
            out.append(key(a))
        elif t in PLAIN:
            out += (t, a)
        elif t is list or t is tuple:
            out += (t, len(a))
            flatten_key(out, a, tensors, key)
        else:
            raise Unkeyed


def spans(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage is exactly what its shape and strides span."""
    with dispatch_disabled():
        made = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    return made.untyped_storage().nbytes() == t.untyped_storage().nbytes()


def _storages(out, into: list) -> list:
    if isinstance(out, torch.Tensor):
        into.append(storage_key(out))
    elif isinstance(out, (tuple, list)):
        for o in out:
            _storages(o, into)
    return into


def _recipe(out, tensor_type: type) -> tuple:
    if isinstance(out, torch.Tensor):
        if type(out) is not tensor_type or (tensor_type is torch.Tensor and not out.is_meta) \
                or out.layout is not torch.strided or out.is_conj() or out.is_neg() \
                or out.requires_grad or out.storage_offset() or not spans(out):
            raise Unkeyed
        return ("t", (tuple(out.shape), out.stride(), out.dtype, out.device))
    if type(out) in PLAIN:
        return ("v", out)
    if type(out) in (tuple, list):
        return (type(out), tuple(_recipe(o, tensor_type) for o in out))
    raise Unkeyed


def recipe(out, inputs: set, tensor_type: type = torch.Tensor) -> tuple:
    """How :func:`remake` makes ``out`` anew, where every tensor in it is fresh: of
    ``tensor_type`` (a plain one on meta), on a storage of its own (no input's in
    ``inputs``, by ``_cdata``, nor another output's) of exactly the bytes its shape and
    strides span, at offset 0, strided, no conjugate or negative bit, no autograd; plain
    values as they are, in tuples and lists. :class:`Unkeyed` otherwise. (The fake mode's
    cache of the functional collectives, :mod:`tpplan.analysis.fake.tensors`, keeps them so too.)"""
    made = _storages(out, [])
    if len(set(made)) != len(made) or not inputs.isdisjoint(made):
        raise Unkeyed
    return _recipe(out, tensor_type)


def remake(kept: tuple, wrap: Callable[[torch.Tensor, torch.device], torch.Tensor] | None = None):
    """The outputs :func:`recipe` kept, made anew: each tensor a new meta tensor of its
    shape, strides and dtype (``wrap(tensor, device)``'s, for a fake one)."""
    kind, parts = kept
    if kind == "t":
        shape, stride, dtype, device = parts
        with dispatch_disabled():
            t = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        return t if wrap is None else wrap(t, device)
    if kind == "v":
        return parts
    return kind(remake(p, wrap) for p in parts)


class MetaCache:
    """Each cacheable operator's outputs by the key of this module's docstring."""

    def __init__(self) -> None:
        self.kept: dict[tuple, tuple] = {}
        self._ops: dict = {}  # op -> whether its schema and tags allow it
        self.hits = self.misses = 0

    def _allowed(self, func) -> bool:
        ok = self._ops.get(func)
        if ok is None:
            schema = op_schema(func)
            ok = self._ops[func] = func.namespace == "aten" \
                and not any(a.alias_info is not None for a in schema.arguments) \
                and not any(r.alias_info is not None for r in schema.returns) \
                and not any(tag in func.tags for tag in _UNSAFE_TAGS)
        return ok

    def __call__(self, func, args, kwargs):
        """``func(*args, **kwargs)``, or its kept outputs made anew."""
        if not self._allowed(func) or dispatch_stack_depth():
            return func(*args, **kwargs)  # (a mode below, such as a fake one, makes them)
        key: list = [func, torch.get_default_dtype()]
        inputs: list = []
        def meta_key(t: torch.Tensor) -> tuple:
            return _meta_key(t, inputs)

        try:
            flatten_key(key, args, _TENSORS, meta_key)
            if kwargs:
                for name, value in kwargs.items():
                    key.append(name)
                    flatten_key(key, (value,), _TENSORS, meta_key)
        except Unkeyed:
            return func(*args, **kwargs)
        if not inputs:  # a factory: left to the kernel
            return func(*args, **kwargs)
        key_t = tuple(key)
        kept = self.kept.get(key_t)
        if kept is not None:
            self.hits += 1
            return remake(kept)
        out = func(*args, **kwargs)
        self.misses += 1
        try:
            self.kept[key_t] = recipe(out, set(inputs))
        except Unkeyed:
            if not set(inputs).isdisjoint(_storages(out, [])):  # on an input's storage, its
                self._ops[func] = False  # schema says not (``_unsafe_view``): never kept
        return out


META = MetaCache()


class MetaCacheMode(Traced, TorchDispatchMode):
    """Every operator on plain tensors through ``cache`` (:data:`META`; a tensor subclass,
    such as DTensor, runs its own dispatch first, and its local operators come back here)."""

    def __init__(self, cache: MetaCache | None = None) -> None:
        super().__init__()
        self.cache = cache or META

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t not in _TENSORS and t is not FakeTensor for t in types):
            return NotImplemented  # (a fake tensor's mode runs below: the kernel runs)
        return self.cache(func, args, kwargs or {})
