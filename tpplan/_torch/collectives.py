"""Functional collectives and process groups by name.

Checked on torch 2.11 through 2.14.1. ``torch.distributed._functional_collectives`` is the
private module of the autograd-aware collectives (``all_to_all_single_autograd``, ...) that
DTensor itself uses; ``_resolve_process_group`` turns a group name (as functional
collectives and DeviceMesh carry them) back into the group.
"""

from __future__ import annotations

import torch.distributed._functional_collectives as funcol
from torch.distributed._functional_collectives import all_gather_tensor, all_to_all_single_autograd
from torch.distributed.distributed_c10d import _resolve_process_group

# The differentiable all-gather (backward: a reduce-scatter): ``all_gather_single_autograd``
# from torch 2.13; torch 2.11 has only ``all_gather_tensor_autograd``, the same gather.
all_gather_single_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd

__all__ = ["all_gather_single_autograd", "all_gather_tensor", "all_to_all_single_autograd",
           "funcol", "resolve_process_group"]


def resolve_process_group(name: str):  # noqa: ANN201 - a ProcessGroup
    """The process group registered under ``name``:
    ``torch.distributed.distributed_c10d._resolve_process_group`` (2.11-2.14.1); raises
    ValueError, RuntimeError or KeyError for a name this process does not know."""
    return _resolve_process_group(name)
