"""Typed access to one located mapping of a plan, every mistake collected with its place."""

from __future__ import annotations

from typing import Any

from .errors import ErrorList, Loc, nearest
from .yamlio import LMap, LSeq

__all__ = ["Reader", "describe"]

NUMBER = (int, float)
_NAMES = {int: "an integer", bool: "true or false", str: "a string", LMap: "a mapping",
          LSeq: "a list", float: "a number"}


def describe(v: Any) -> str:
    """What a value is, in the words of an error message: 'a mapping', 'a boolean', ..."""
    if isinstance(v, LMap):
        return "a mapping"
    if isinstance(v, LSeq):
        return "a list"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            type(None): "null"}.get(type(v), type(v).__name__)


def _expected(kind: Any) -> str:
    if isinstance(kind, tuple):
        return "a number" if kind == NUMBER else " or ".join(_NAMES.get(k, k.__name__) for k in kind)
    return _NAMES.get(kind, kind.__name__)


def _is(value: Any, kind: Any) -> bool:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    # YAML's true/false are Python ints; a plan never means a number by them.
    if isinstance(value, bool) and bool not in kinds:
        return False
    return isinstance(value, kinds)


class Reader:
    """One section (``where``) of the plan: unknown keys are reported on construction with
    the nearest valid name, and :meth:`get` checks each value's type."""

    def __init__(self, errs: ErrorList, where: str, m: Any, loc: Loc | None, allowed: tuple):
        self.errs, self.where = errs, where
        if m is None:
            m = LMap(loc or Loc("<plan>", 0, 0))
        if not isinstance(m, LMap):
            errs.add(f"'{where}' must be a mapping, got {describe(m)}", loc)
            m = LMap(loc or Loc("<plan>", 0, 0))
        self.m = m
        for key in m:
            if key not in allowed:
                errs.add(f"unknown key '{key}' in '{where}'{nearest(key, allowed)}; "
                         f"expected one of: {', '.join(allowed)}", m.key_loc(key))

    @classmethod
    def section(cls, errs: ErrorList, doc: LMap, key: str, allowed: tuple,
                value: Any = None) -> "Reader":
        """The top-level section ``key`` of the plan ``doc`` (empty where it is absent);
        ``value`` stands in for the section as written (a shorthand expanded)."""
        loc = doc.value_loc(key) if key in doc else doc.loc
        return cls(errs, key, doc.get(key) if value is None else value, loc, allowed)

    def loc(self, key: str) -> Loc:
        return self.m.value_loc(key) if key in self.m else self.m.loc

    def locs(self) -> dict[str, Loc]:
        """Where each given key's value stands: later checks point there."""
        return {k: self.loc(k) for k in self.m}

    def get(self, key: str, kind: type | tuple, default: Any, what: str = "") -> Any:
        """The value of ``key`` if it is of ``kind`` (``default`` if absent or null);
        otherwise an error at the value and ``default``."""
        if key not in self.m or self.m[key] is None:
            return default
        v = self.m[key]
        if not _is(v, kind):
            self.errs.add(f"'{self.where}.{key}' must be {what or _expected(kind)}, got "
                          f"{describe(v)} {v!r}", self.loc(key))
            return default
        return v

    def number(self, key: str, default: float | None) -> float | None:
        """A real number (an integer is read as one); never a boolean."""
        v = self.get(key, NUMBER, default, "a number")
        return float(v) if v is not None else None

    def at_least(self, key: str, value: Any, low: float) -> None:
        """Report ``value`` (already read from ``key``) below ``low``."""
        if value is not None and value < low:
            self.errs.add(f"'{self.where}.{key}' must be at least {low}, got {value}", self.loc(key))
