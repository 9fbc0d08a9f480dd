"""The plan layer: YAML with locations -> a typed :class:`PlanSpec`. No torch, no model.

Reading (``yamlio``, ``loader``: extends and ``--set``; ``read``: a file to its document
and spec), the typed reader (``reader``), the specs (``specs``) and their parsers
(``sections``, ``rules``, ``trainer``), the style vocabulary (``styles``), module-path
patterns (``patterns``), the step a trainer runs (``step``), writing plans back out
(``writer``) and the accelerators a plan is checked against (``devices``: pure data).
Everything above imports from here; this package imports nothing above it.
"""

from __future__ import annotations

from .errors import CommandError, ErrorList, Loc, PlanError, PlanErrors, nearest
from .loader import read_document
from .read import read_plan
from .sections import parse_plan
from .specs import PlanSpec
from .step import StepShape, step_shape

__all__ = ["CommandError", "ErrorList", "Loc", "PlanError", "PlanErrors", "PlanSpec", "StepShape", "nearest",
           "parse_plan", "read_document", "read_plan", "step_shape"]

