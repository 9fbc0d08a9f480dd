"""The one error a data file can raise: a mistake in it, said in one line naming the file."""

from __future__ import annotations

__all__ = ["DataError"]


class DataError(Exception):
    """A mistake in a data file (``file:line: ...``) or in what it holds; one line."""
