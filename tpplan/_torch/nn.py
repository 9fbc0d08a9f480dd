"""``nn.Module`` internals: where parameters are registered, which buffers are not saved.

Checked on torch 2.11 through 2.14.1.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch
import torch.nn as nn

__all__ = ["initializers_seen", "non_persistent_buffers", "parameters_on_meta"]

# nn.init functions that return a meta tensor untouched, drawing nothing (torch 2.11-2.14.1),
# and go through no torch-function or dispatch mode.
_META_NO_OPS = ("trunc_normal_", "orthogonal_", "sparse_", "dirac_")


@contextlib.contextmanager
def initializers_seen(draw: bool) -> Iterator[None]:
    """Within the block, ``nn.init``'s initializers that skip a meta tensor write into it:
    with ``draw``, computed on a CPU stand-in of its shape and copied in (the random stream
    advances as on CPU; a dispatch mode sees the ``copy_``); without, a ``zero_`` that only
    shows the write. Patches the ``torch.nn.init`` attributes, restored on exit."""
    originals = {name: getattr(nn.init, name) for name in _META_NO_OPS}

    def seen(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            tensor = args[0] if args else kwargs["tensor"]
            if not (isinstance(tensor, torch.Tensor) and tensor.is_meta):
                return fn(*args, **kwargs)
            with torch.no_grad():
                if not draw:
                    return tensor.zero_()
                stand_in = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype)
                fn(stand_in, *args[1:], **{k: v for k, v in kwargs.items() if k != "tensor"})
                return tensor.copy_(stand_in)
        return run
    for name, fn in originals.items():
        setattr(nn.init, name, seen(fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(nn.init, name, fn)



def non_persistent_buffers(module: nn.Module) -> set[str]:
    """The names of ``module``'s own buffers left out of its state dict:
    ``module._non_persistent_buffers_set`` (2.11-2.14.1)."""
    return module._non_persistent_buffers_set


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter created inside goes to the meta device; buffers stay real.

    Patches ``nn.Module.register_parameter`` (every ``nn.Parameter`` assigned to a module
    goes through it, 2.11-2.14.1) and writes the meta copy into the module's
    ``_parameters``; restored on exit."""
    original = nn.Module.register_parameter

    def register(self, name, param):
        original(self, name, param)
        if param is not None and param.device.type != "meta":
            self._parameters[name] = nn.Parameter(param.to("meta"),
                                                  requires_grad=param.requires_grad)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original
