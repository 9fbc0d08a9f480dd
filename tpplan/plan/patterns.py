"""Module-path patterns: the names ``named_modules()`` prints, with two wildcards.

``*`` matches one path segment (``layers.*.attention``), ``?`` one character inside a
segment, and ``{a,b}`` any of the alternatives (``attention.{wq,wk,wv}``). A pattern is
matched against the whole path. ``re:`` before a pattern makes it a Python regular
expression, for the rare plan that needs one (``re:layers\\.(0|1)\\.attention``).
"""

from __future__ import annotations

import re
from functools import lru_cache

__all__ = ["compile_pattern", "enclosing", "generalize", "is_in_blocks", "matches"]


@lru_cache(maxsize=4096)
def compile_pattern(pattern: str) -> re.Pattern:
    """The regex for a plan pattern; raises ValueError with what is wrong."""
    if not isinstance(pattern, str) or not pattern.strip():
        raise ValueError("a pattern must be a non-empty module path")
    if pattern.startswith("re:"):
        try:
            return re.compile(pattern[3:])
        except re.error as e:
            raise ValueError(f"bad regular expression: {e}") from None
    out: list[str] = []
    in_braces = False
    for ch in pattern:
        if ch == "{":
            if in_braces:
                raise ValueError("nested '{' is not supported")
            in_braces = True
            out.append("(?:")
        elif ch == "}":
            if not in_braces:
                raise ValueError("'}' without '{'")
            in_braces = False
            out.append(")")
        elif ch == "," and in_braces:
            out.append("|")
        elif ch == "*":
            out.append("[^.]+")
        elif ch == "?":
            out.append("[^.]")
        elif ch.isspace():
            raise ValueError("a module path has no spaces")
        else:
            out.append(re.escape(ch))
    if in_braces:
        raise ValueError("'{' without '}'")
    if ".." in pattern or pattern.startswith(".") or pattern.endswith("."):
        raise ValueError("empty path segment")
    return re.compile("".join(out))


def matches(pattern: str, path: str) -> bool:
    return compile_pattern(pattern).fullmatch(path) is not None


# A path segment that is all digits: after a dot or a quote (a path quoted in a message),
# before a dot, a quote or the end.
_INDEX = re.compile(r"(?<=[.'])\d+(?=[.']|$)|^\d+(?=\.|$)")


def generalize(path: str) -> str:
    """``layers.3.attention`` -> ``layers.*.attention``: how a path is written in a plan.

    Works on text too: ``module 'layers.3.wq' ...`` -> ``module 'layers.*.wq' ...``, so the
    same mistake in every block collapses to one message."""
    return _INDEX.sub("*", path)


def is_in_blocks(path: str) -> bool:
    """Whether ``path`` lies inside a numbered container (a repeated block)."""
    return generalize(path) != path


def enclosing(path: str, owners) -> str | None:
    """The first of ``owners`` (module paths) that ``path`` lies strictly inside, or None:
    ``enclosing("layers.0.moe.experts.3.w1", ["layers.0.moe.experts"])`` is the list."""
    return next((o for o in owners if path.startswith(o + ".")), None)
