"""The fake tensor mode the memory trace runs its steps in: PyTorch's ``FakeTensorMode``
with a cheaper key for its dispatch cache.

``FakeTensorMode`` caches each operator's output metadata under a key made of the
operator and its arguments, every fake tensor turned into its full ``TensorMetadata``
(17 fields, its shape and strides walked one element at a time, its memory format
worked out from them). In a traced step that key costs more than the operator it saves:
about half the trace's time went into building it (docs/benchmarks.md).

:class:`TraceMode` keys a plain dense fake tensor (strided, of this mode, no constant, no
symbolic size) by ``(dtype, shape, strides, device, storage offset, storage bytes,
requires_grad, is_quantized, is_conj, is_neg, is_inference)``. Everything else in
PyTorch's metadata is a function of these for such a tensor (its layout is strided, so it
is not sparse; its memory format follows from its shape and strides), so two calls get
the same key only where PyTorch's own key is the same too: a hit is a hit PyTorch would
have made. Any other argument (a dict, a symbolic size, a tensor of another kind, an
object not plainly hashable) hands the whole call to PyTorch's own key, which also
decides what must bypass the cache. The keys are tagged, so the two kinds never meet.

PyTorch's cache passes three kinds of operator by that a trace calls again and again; the
trace mode takes them as what they are: ``_unsafe_view`` as ``view`` (its kernel's), the
``empty_like`` of a plain dense meta tensor as ``empty_strided`` of its shape and strides,
and the functional collectives (another namespace) from a cache of its own, kept only where
their outputs are fresh tensors (:meth:`TraceMode._functional`).

Where this PyTorch's ``FakeTensorMode`` has no ``_prep_args_for_hash`` of the expected
signature, :func:`fake_mode` gives the plain mode. ``tests/test_memory_trace.py`` holds a
step traced in either mode to the same moments, and the key to PyTorch's on equality.
"""

from __future__ import annotations

import torch

from ..._torch.dispatch import tree_flatten
from ..._torch.fake import (FakeTensor, FakeTensorMode, FastKeyedFakeMode, dense_strides,
                            fast_key_overridable, has_symbolic_shape)
from ..._torch.ops import UNSAFE_VIEW
from ..._torch.storage import storage_key

from ...parallel.meta_kernel_cache import Unkeyed, flatten_key, recipe, remake

__all__ = ["TraceMode", "fake_mode"]

_TAG = ("tpplan.fakemode",)  # in front of each fast key: never equal to PyTorch's
_UNSAFE_VIEW, _VIEW = UNSAFE_VIEW, torch.ops.aten.view.default
_EMPTY_LIKE, _EMPTY_STRIDED = torch.ops.aten.empty_like.default, torch.ops.aten.empty_strided.default


def _plain_meta(args, kwargs) -> bool:
    """``empty_like``'s arguments where it makes what ``empty_strided`` of the input's shape
    and strides makes: a plain dense meta tensor, its memory format preserved."""
    if len(args) != 1 or type(args[0]) not in (torch.Tensor, torch.nn.Parameter):
        return False
    t, kwargs = args[0], kwargs or {}
    return t.device.type == "meta" and t.layout is torch.strided \
        and kwargs.get("memory_format") in (None, torch.preserve_format) \
        and set(kwargs) <= {"dtype", "layout", "device", "pin_memory", "memory_format"} \
        and kwargs.get("layout") in (None, torch.strided) and dense_strides(t)


_FAKE = (FakeTensor,)


def _dense(mode: FakeTensorMode, t: FakeTensor) -> tuple:
    if t.fake_mode is not mode or t.constant is not None or t.layout is not torch.strided \
            or has_symbolic_shape(t):
        raise Unkeyed
    return (t.dtype, tuple(t.shape), t.stride(), t.device, t.storage_offset(),
            t.untyped_storage().nbytes(), t.requires_grad, t.is_quantized, t.is_conj(),
            t.is_neg(), t.is_inference())


def _flatten(mode: FakeTensorMode, out: list, args) -> None:
    kind = type(args)
    if kind is list or kind is tuple:
        out += (kind, len(args))
    elif kind is not type({}.keys()) and kind is not type({}.values()):
        raise Unkeyed  # a dict, or an iterable PyTorch's key knows how to take
    flatten_key(out, args, _FAKE, lambda t: _dense(mode, t))


class TraceMode(FastKeyedFakeMode):
    """``FakeTensorMode`` with the cheaper cache key of this module's docstring, its
    dispatch called as written: without the frame-evaluation guard (and call counter)
    PyTorch wraps it in, as :class:`~tpplan.analysis.memory.tracker.MemoryTracker` (no compile
    runs under a trace)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._collectives: dict[tuple, list] = {}

    def dispatch(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional" and not kwargs:
            return self._functional(func, types, args)
        if func is _UNSAFE_VIEW:  # a view by its kernel, not by its schema: as one, cached
            func = _VIEW
        elif func is _EMPTY_LIKE and _plain_meta(args, kwargs):  # a meta parameter made fake
            t, kwargs = args[0], kwargs or {}
            func, args = _EMPTY_STRIDED, (tuple(t.shape), t.stride())
            kwargs = dict(dtype=kwargs.get("dtype") or t.dtype, layout=torch.strided,
                          device=kwargs.get("device") or t.device,
                          pin_memory=kwargs.get("pin_memory"))
        return super().dispatch(func, types, args, kwargs)

    def _functional(self, func, types, args):
        """A functional collective (PyTorch's cache passes its namespace by) served from
        this mode's own: kept by the fast key of its arguments where its outputs are fresh
        fake tensors (:func:`~tpplan.parallel.meta_kernel_cache.recipe`; its meta kernel allocates
        them: ``wait_tensor``'s is ``empty_like``); anything else runs every time."""
        key: list = [func]
        try:
            _flatten(self, key, args)
        except Unkeyed:
            return super().dispatch(func, types, args, {})
        kept = self._collectives.get(tuple(key))
        if kept is not None:
            return remake(kept, lambda t, device: FakeTensor(self, t, device))
        out = super().dispatch(func, types, args, {})
        inputs = {storage_key(a) for a in tree_flatten(args)[0]
                  if isinstance(a, torch.Tensor)}
        try:
            self._collectives[tuple(key)] = recipe(out, inputs, FakeTensor)
        except Unkeyed:
            pass
        return out

    def fast_key(self, args: tuple) -> list | None:
        """The fast key of ``args`` (None where an argument is one it does not take)."""
        out: list = [_TAG]
        try:
            _flatten(self, out, args)
        except Unkeyed:  # an argument the fast key does not take: PyTorch's own key
            return None
        return out


_MODE = TraceMode if fast_key_overridable() else FakeTensorMode


def fake_mode(**kwargs) -> FakeTensorMode:
    """A :class:`TraceMode` (``FakeTensorMode`` where this PyTorch's differs)."""
    return _MODE(**kwargs)
