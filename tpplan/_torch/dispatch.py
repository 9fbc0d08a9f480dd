"""Dispatch-level internals: modes, pytrees, operator handles and ``torch._C`` switches.

Checked on torch 2.11 through 2.14.1. ``torch.utils._python_dispatch`` and
``torch.utils._pytree`` are private modules that every torch dispatch mode imports from;
``torch._C``'s switches are the ones PyTorch's own modes use.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

__all__ = ["HigherOrderOperator", "TorchDispatchMode", "Traced", "dispatch_disabled",
           "dispatch_stack_depth", "is_traceable_wrapper_subclass", "op_packet", "op_schema",
           "torch_function_disabled", "tree_flatten"]


class Traced:
    """A mixin for a dispatch mode that no compiled code runs under.

    Relies on the classmethod ``TorchDispatchMode._should_skip_dynamo`` (2.11-2.14.1): no
    compile runs under tpplan's modes, so the frame-evaluation guard PyTorch wraps a mode's
    ``__torch_dispatch__`` in when it answers True would only cost each op's dispatch its
    setup. Put it first among the bases so it takes precedence."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


def op_packet(func: Any) -> Any:
    """An ``OpOverload``'s packet (``aten.add`` of ``aten.add.Tensor``): ``func._overloadpacket``
    (2.11-2.14.1), the name every dispatch mode keys collectives and kernels by."""
    return func._overloadpacket


def op_schema(func: Any) -> Any:
    """An ``OpOverload``'s ``FunctionSchema`` (arguments, returns and their alias info):
    ``func._schema`` (2.11-2.14.1)."""
    return func._schema


# Within its block, tensor subclasses' ``__torch_dispatch__`` is skipped: the class itself
# (``torch._C._DisableTorchDispatch``), no wrapper, as the meta cache enters it per op.
dispatch_disabled = torch._C._DisableTorchDispatch


def torch_function_disabled() -> contextlib.AbstractContextManager:
    """Within the block, ``__torch_function__`` overrides are skipped:
    ``torch._C.DisableTorchFunction`` (2.11-2.14.1)."""
    return torch._C.DisableTorchFunction()


# How many dispatch modes are active below the running one: ``torch._C._len_torch_dispatch_stack``
# itself, no wrapper (asked once per op).
dispatch_stack_depth = torch._C._len_torch_dispatch_stack
