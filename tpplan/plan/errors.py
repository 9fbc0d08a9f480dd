"""Located errors: every mistake in a plan points at a file, a line and a column."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Callable, Iterable

__all__ = ["CommandError", "ErrorList", "Loc", "PlanError", "PlanErrors", "nearest", "Part",
           "run_part"]


@dataclass(frozen=True)
class Loc:
    """A place in a plan file. Lines and columns count from 1, as editors show them."""

    file: str
    line: int
    column: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"


UNKNOWN = Loc("<plan>", 0, 0)


class PlanError(Exception):
    """One mistake in a plan, with where it is. ``str()`` reads ``file:line:col: message``."""

    def __init__(self, message: str, loc: Loc | None = None):
        super().__init__(message)
        self.message = message
        self.loc = loc or UNKNOWN

    def __str__(self) -> str:
        return f"{self.loc}: {self.message}"

    def to_json(self) -> dict:
        return {
            "file": self.loc.file,
            "line": self.loc.line,
            "column": self.loc.column,
            "message": self.message,
        }


class PlanErrors(Exception):
    """Every mistake found in one pass over a plan, in file order."""

    def __init__(self, errors: Iterable[PlanError]):
        self.errors = sorted(errors, key=lambda e: (e.loc.file, e.loc.line, e.loc.column))
        super().__init__("\n".join(str(e) for e in self.errors))

    def __str__(self) -> str:
        return "\n".join(str(e) for e in self.errors)


class CommandError(Exception):
    """A mistake in what a command was given outside any plan file: a path that cannot be
    read, an output that would replace an input, a checkpoint that does not load. The
    command line prints it as one ``error:`` line and exits 1."""


class ErrorList(list):
    """Collects errors while a pass goes on, so the user sees them all at once."""

    def add(self, message: str, loc: Loc | None) -> None:
        self.append(PlanError(message, loc))

    def raise_if_any(self) -> None:
        if self:
            raise PlanErrors(self)


# ``part(key, errs, run)``: ``run(errs)``, its errors added to ``errs``, its value returned;
# or a cache's earlier value and errors under ``key``, which names what the part reads that
# the variants of one plan change (parse_plan's sections, resolve's parts; ``search``'s
# cache is tpplan.analysis.search.check_cache). Without a cache: :func:`run_part`.
Part = Callable[[tuple, "ErrorList", Callable[["ErrorList"], Any]], Any]


def run_part(_key: tuple, errs: ErrorList, run: Callable[[ErrorList], Any]) -> Any:
    """The uncached :data:`Part`: ``run(errs)``."""
    return run(errs)


def nearest(name: str, candidates: Iterable[str], cutoff: float = 0.6) -> str:
    """`` (did you mean 'x'?)`` for the closest candidate, or an empty string."""
    match = difflib.get_close_matches(str(name), list(candidates), n=1, cutoff=cutoff)
    return f" (did you mean '{match[0]}'?)" if match else ""
