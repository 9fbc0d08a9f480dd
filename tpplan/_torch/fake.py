"""Fake tensors: ``torch._subclasses.fake_tensor`` and the fake mode's cache hook.

Checked on torch 2.11 through 2.14.1. ``FakeTensorMode`` lives in the private
``torch._subclasses`` package (no public path exists); ``_prep_args_for_hash`` is the
mode's per-call cache-key builder, overridden by :class:`FastKeyedFakeMode`.
"""

from __future__ import annotations

import inspect

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, is_fake

from .dispatch import Traced

__all__ = ["FakeTensor", "FakeTensorMode", "FastKeyedFakeMode", "dense_strides",
           "fast_key_overridable", "has_symbolic_shape", "is_fake"]


# Whether a tensor's strides are non-overlapping and dense (False where unknown): the name
# itself, not a wrapper (a trace asks it of every tensor of every op).
dense_strides = is_non_overlapping_and_dense_or_false


def has_symbolic_shape(t: torch.Tensor) -> bool:
    """Whether ``t``'s sizes or strides are symbolic: ``t._has_symbolic_sizes_strides``
    (2.11-2.14.1)."""
    return t._has_symbolic_sizes_strides


def fast_key_overridable() -> bool:
    """Whether this torch's ``FakeTensorMode._prep_args_for_hash`` takes the arguments
    :class:`FastKeyedFakeMode` overrides it with (2.11-2.14.1: ``(self, result, args, state,
    id_hashed_objects)``); where not, the mode's own key is used."""
    method = getattr(FakeTensorMode, "_prep_args_for_hash", None)
    if method is None:
        return False
    return list(inspect.signature(method).parameters) == [
        "self", "result", "args", "state", "id_hashed_objects"]


class FastKeyedFakeMode(Traced, FakeTensorMode):
    """``FakeTensorMode`` whose cache key for a call comes from :meth:`fast_key` first, its
    dispatch called as written: without the frame-evaluation guard (and call counter)
    PyTorch wraps it in (no compile runs under a trace; see :class:`Traced`).

    Relies on ``FakeTensorMode._prep_args_for_hash(result, args, state, id_hashed_objects)``
    (2.11-2.14.1), which appends the key of ``args`` to ``result``; check
    :func:`fast_key_overridable` before using the hook's result as the key. The unguarded
    dispatch is ``inspect.unwrap`` of the class's own ``__torch_dispatch__``."""

    __torch_dispatch__ = inspect.unwrap(FakeTensorMode.__dict__["__torch_dispatch__"])

    def fast_key(self, args: tuple) -> list | None:
        """The key of ``args``, or None for the mode's own. Subclasses override it."""
        return None

    def _prep_args_for_hash(self, result, args, state, id_hashed_objects):  # noqa: D401
        out = self.fast_key(args)
        if out is None:  # an argument the fast key does not take: PyTorch's own key
            return super()._prep_args_for_hash(result, args, state, id_hashed_objects)
        result += out
        return None
