"""Private-named operators tpplan's dispatch modes recognise.

Checked on torch 2.11 through 2.14.1 (each is an ``OpOverload`` in ``torch.ops``).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["FOREACH_COPY", "LOCAL_SCALAR_DENSE", "RECORD_FUNCTION_MARKS", "TO_COPY", "UNSAFE_VIEW",
           "reduce_scatter_base"]

# ``aten._unsafe_view``: a view by its kernel, not by its schema (``reshape``'s copy path).
UNSAFE_VIEW = torch.ops.aten._unsafe_view.default
# what .item() / .tolist() of a tensor dispatch (a fake one), and a copy off the meta device
LOCAL_SCALAR_DENSE = torch.ops.aten._local_scalar_dense.default
TO_COPY = torch.ops.aten._to_copy.default
# ``aten._foreach_copy_``: FSDP2's copy of a unit's gradients/parameters in one call.
FOREACH_COPY = torch.ops.aten._foreach_copy_.default
# ``record_function``'s marks (enter, exit by handle, exit by object): ops that make nothing.
RECORD_FUNCTION_MARKS = (torch.ops.profiler._record_function_enter_new.default,
                         torch.ops.profiler._record_function_exit.default,
                         torch.ops.profiler._record_function_exit._RecordFunction)


def reduce_scatter_base() -> Any:
    """``c10d._reduce_scatter_base_`` (FSDP2's reduce-scatter); the ``c10d`` namespace is
    registered once ``torch.distributed`` is imported, hence a function."""
    return torch.ops.c10d._reduce_scatter_base_.default
