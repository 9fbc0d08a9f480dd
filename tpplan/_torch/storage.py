"""Storages: their identity and their resizes.

Checked on torch 2.11 through 2.14.1.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

__all__ = ["resizes_seen", "storage_key"]


def storage_key(t: torch.Tensor) -> int:
    """The address of ``t``'s storage's C++ object, equal for every view of one storage while
    it lives: ``untyped_storage()._cdata`` (2.11-2.14.1), without keeping the storage."""
    return t.untyped_storage()._cdata


@contextlib.contextmanager
def resizes_seen(seen: Callable[[torch.UntypedStorage, int], None]) -> Iterator[None]:
    """Within the block, ``seen(storage, size)`` runs after every
    ``torch.UntypedStorage.resize_`` (how FSDP2 frees and refills unsharded parameters;
    no dispatch mode sees it). Patches the class attribute, restored on exit."""
    original = torch.UntypedStorage.resize_

    def resize_(st: torch.UntypedStorage, size: int):
        out = original(st, size)
        seen(st, size)
        return out

    torch.UntypedStorage.resize_ = resize_
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original
