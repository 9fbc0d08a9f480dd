"""The autograd engine's state, as the running code sees it.

Checked on torch 2.11 through 2.14.1: ``torch._C._current_graph_task_id`` (-1 outside a
backward), ``torch._C._current_autograd_node`` and a node's ``_sequence_nr()`` (its place in
forward's order) are what ``torch.utils.checkpoint`` and the profiler read.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["current_autograd_node", "in_backward", "sequence_nr"]


def in_backward() -> bool:
    """Whether the autograd engine is running a backward in this thread:
    ``torch._C._current_graph_task_id() != -1``."""
    return torch._C._current_graph_task_id() != -1


def current_autograd_node() -> Any:
    """The autograd node whose backward is running, or None: ``torch._C._current_autograd_node``."""
    return torch._C._current_autograd_node()


def sequence_nr(node: Any) -> int:
    """An autograd node's sequence number (forward's order of the ops that made it):
    ``node._sequence_nr()``."""
    return node._sequence_nr()
