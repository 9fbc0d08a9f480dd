"""Distributed checkpoint (DCP) internals.

Checked on torch 2.11 through 2.14.1.
"""

from __future__ import annotations

from typing import Any

__all__ = ["metadata_path"]


def metadata_path(reader: Any, rank: int | None) -> Any:
    """The path of the ``.metadata`` file a ``FileSystemReader`` reads (per rank where DCP
    keeps one each): ``FileSystemReader._get_metadata_path(rank)``."""
    return reader._get_metadata_path(rank)
