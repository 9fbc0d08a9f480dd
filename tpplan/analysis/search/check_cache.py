"""The parts of a candidate's check, cached across the variants of one plan (``search``).

``tpplan search`` checks every candidate (tens of thousands on a large world) as ``dry_run``
does: the plan's sections parsed (:func:`tpplan.plan.parse_plan`), the model resolved
(:func:`tpplan.parallel.resolve.resolve`, the stage contract where there is a pipeline).
The candidates are one plan with a few ``--set`` lines (the mesh, checkpointing, the
pipeline, the micro-batch), and most of that work reads none of what differs between two of
them. Both functions hand each of their parts to a :data:`tpplan.plan.errors.Part` under a
key naming what the part reads that a variant can change; :class:`PartCache` is that
callable: a part already run under its key gives back its value and its errors.

- A section of the plan is keyed by the ``--set`` lines that touch the document keys it
  reads (:meth:`PartCache.sections`): its text, and so its value and errors, follows from the
  base document and those lines.
- A part of a resolution names in its key the degrees it reads (the rules' matches and
  checks: tp; the experts' checks: tp and ep; the stage split: pp, stages per rank, V
  placement, split points; checkpointing's blocks: the pattern), the model and the plan's
  other sections being the cache's own.

An error is located where the plan says the thing it refuses. A part's errors may sit in a
``--set`` line's text that its key does not name (the mesh's line, whose degrees the key
names only in part): such an entry is reused only by a variant that has the same lines
(:meth:`PartCache.__call__`), so every error keeps this variant's place.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Sequence

from ...plan import ErrorList

__all__ = ["PartCache", "OVERRIDE"]

OVERRIDE = "--set "  # how a --set line's locations name their file (plan.loader)


class PartCache:
    """A :data:`tpplan.plan.errors.Part` that remembers: ``cache(key, errs, run)`` gives
    back the value and errors of an earlier ``run`` under ``key`` where their locations
    are this variant's, else runs it. ``overrides``: the plan's own ``--set`` lines (in every
    variant); :meth:`variant` names the variant's lines before its check."""

    def __init__(self, overrides: Sequence[str] = (), counts: Counter | None = None):
        self.entries: dict[tuple, list[tuple[Any, list, frozenset]]] = {}
        self.base = frozenset(OVERRIDE + s for s in overrides)
        self.lines = self.base
        self.sets: tuple[str, ...] = ()
        self.counts = Counter() if counts is None else counts

    def variant(self, sets: Sequence[str]) -> None:
        """The next parts are the variant's with ``sets``."""
        self.sets = tuple(sets)
        self.lines = self.base | {OVERRIDE + s for s in sets}

    def __call__(self, key: tuple, errs: ErrorList, run: Callable[[ErrorList], Any]) -> Any:
        for value, errors, files in self.entries.get(key, ()):
            if files <= self.lines:
                errs.extend(errors)
                return value
        mine = ErrorList()
        value = run(mine)
        # The --set lines its errors point into: the entry holds for variants with them.
        files = frozenset(e.loc.file for e in mine
                          if e.loc is not None and e.loc.file.startswith(OVERRIDE))
        self.entries.setdefault(key, []).append((value, list(mine), files))
        self.counts[f"check_{key[0]}"] += 1
        errs.extend(mine)
        return value

    def sections(self, key: tuple, errs: ErrorList, run: Callable[[ErrorList], Any]) -> Any:
        """For :func:`tpplan.plan.parse_plan`: a section (``key``: ``("section", *document
        keys it reads)``) keyed by the variant's lines that set those keys."""
        touching = tuple(s for s in self.sets
                         if s.partition("=")[0].strip().split(".")[0] in key[1:])
        return self(("section", key[1:], touching), errs, run)
