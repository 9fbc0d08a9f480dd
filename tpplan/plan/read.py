"""A plan file read whole: its merged document (``extends`` and ``--set`` applied) and its
spec, every mistake of either as one :class:`PlanErrors`."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .errors import PlanError, PlanErrors
from .loader import read_document
from .sections import parse_plan
from .specs import PlanSpec
from .yamlio import LMap

__all__ = ["read_plan"]


def read_plan(path: str | Path, overrides: Sequence[str] = ()) -> tuple[LMap, PlanSpec]:
    """The merged document and its spec: ``(LMap, PlanSpec)``; :class:`PlanErrors` lists
    every mistake, each ``file:line:col``."""
    try:
        doc = read_document(path, overrides)
    except PlanError as e:
        raise PlanErrors([e]) from None
    return doc, parse_plan(doc, str(path))
