"""``nn.Module`` internals: where parameters are registered, which buffers are not saved.

Checked on torch 2.11 through 2.14.1.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.nn as nn

__all__ = ["non_persistent_buffers", "parameters_on_meta"]


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
