"""The plan layer: YAML with locations -> a typed :class:`PlanSpec`. No torch, no model.

Reading (``yamlio``, ``loader``: extends and ``--set``), the typed reader (``reader``),
the specs (``specs``) and their parsers (``sections``, ``rules``, ``trainer``), the style
vocabulary (``styles``), module-path patterns (``patterns``), the step a trainer runs
(``step``), writing plans back out (``writer``) and the accelerators a plan is checked
against (``devices``: pure data). Everything above imports from here;
this package imports nothing above it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .errors import CommandError, ErrorList, Loc, PlanError, PlanErrors, nearest
from .loader import read_document
from .sections import parse_plan
from .specs import PlanSpec
from .step import StepShape, step_shape

__all__ = ["CommandError", "ErrorList", "Loc", "PlanError", "PlanErrors", "PlanSpec", "StepShape", "nearest",
           "parse_plan", "read_document", "read_plan", "step_shape"]


def read_plan(path: str | Path, overrides: Sequence[str] = ()):
    """The merged document and its spec: ``(LMap, PlanSpec)``; :class:`PlanErrors` lists
    every mistake, each ``file:line:col``."""
    try:
        doc = read_document(path, overrides)
    except PlanError as e:
        raise PlanErrors([e]) from None
    return doc, parse_plan(doc, str(path))
