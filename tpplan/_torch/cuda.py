"""The CUDA caching allocator's memory history (the snapshot ``pytorch.org/memory_viz`` reads).

Checked on torch 2.11 through 2.14.1: ``torch.cuda.memory._record_memory_history`` and
``_dump_snapshot`` are the documented way to take a snapshot (docs: "Understanding CUDA
Memory Usage"), private-named since they were added.
"""

from __future__ import annotations

import torch

__all__ = ["dump_memory_snapshot", "record_memory_history", "stop_memory_history"]


def record_memory_history(max_entries: int) -> None:
    """Start recording the allocator's history, keeping the last ``max_entries`` events."""
    torch.cuda.memory._record_memory_history(max_entries=max_entries)


def dump_memory_snapshot(path: str) -> None:
    """Write the recorded history to ``path`` (a pickle)."""
    torch.cuda.memory._dump_snapshot(path)


def stop_memory_history() -> None:
    """Stop recording the allocator's history."""
    torch.cuda.memory._record_memory_history(enabled=None)
