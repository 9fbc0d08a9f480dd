"""The ``tensor_parallel`` section: ``pattern: style`` rules, each style's options checked.

Syntax and types only; whether a pattern matches the model is for
:mod:`tpplan.parallel.resolve`, which has the model.
"""

from __future__ import annotations

from typing import Any

from .errors import ErrorList, Loc, nearest
from .patterns import compile_pattern
from .reader import describe
from .specs import Rule
from .styles import (
    ALIASES, BOOL, INT, KWARG_LAYOUTS, LAYOUT, LAYOUT_WORDS, LAYOUTS, NAMES, PARTS, REQUIRED, STYLES,
    StyleSpec,
    parse_layout,
)
from .yamlio import LMap, LSeq

__all__ = ["parse_rules", "parse_style"]


def _parse_option(kind: str, value: Any, loc: Loc, name: str, errs: ErrorList) -> Any:
    try:
        if kind == BOOL:
            if not isinstance(value, bool):
                raise ValueError(f"'{name}' must be true or false, got {value!r}")
            return value
        if kind == INT:
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"'{name}' must be an integer, got {value!r}")
            return value
        if kind == PARTS:
            return _parse_parts(value, name)
        if kind == NAMES:
            names = [value] if isinstance(value, str) else value
            if not isinstance(names, LSeq | list) or not names or not all(
                    isinstance(v, str) and v.isidentifier() for v in names):
                raise ValueError(f"'{name}' is a parameter name or a list of them, got {value!r}")
            return list(names)
        if kind == LAYOUT:
            return parse_layout(value)
        if kind == LAYOUTS:
            if isinstance(value, LSeq):
                out = []
                for i, v in enumerate(value):
                    try:
                        out.append(parse_layout(v))
                    except ValueError as e:
                        errs.add(f"{e}{nearest(str(v), LAYOUT_WORDS)}", value.item_loc(i))
                        out.append(None)  # keep positions, so only this item is reported
                return out
            return parse_layout(value)
        if kind == KWARG_LAYOUTS:
            if not isinstance(value, LMap):
                raise ValueError(f"'{name}' must map keyword names to layouts")
            out = {}
            for k, v in value.items():
                try:
                    out[str(k)] = parse_layout(v)
                except ValueError as e:
                    errs.add(f"{e}{nearest(str(v), LAYOUT_WORDS)}", value.value_loc(k))
            return out
    except ValueError as e:
        hint = nearest(str(value), LAYOUT_WORDS) if kind in (LAYOUT, LAYOUTS) else ""
        errs.add(f"{e}{hint}", loc)
    return None


def _parse_parts(value: Any, name: str) -> int | list[int | str]:
    """``parts: 2`` (equal parts) or ``parts: [num_attention_heads, num_key_value_heads,
    num_key_value_heads]`` (relative sizes: integers or attribute names)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 2:
        return value
    if isinstance(value, LSeq) and len(value) >= 2 and all(
            (isinstance(v, int) and not isinstance(v, bool) and v > 0)
            or (isinstance(v, str) and v.isidentifier()) for v in value):
        return list(value)
    raise ValueError(f"'{name}' is a number of equal parts (2 or more) or a list of the parts' "
                     f"relative sizes (positive integers or attribute names), got {value!r}")


def parse_style(value: Any, loc: Loc, errs: ErrorList) -> StyleSpec | None:
    names = list(STYLES) + list(ALIASES)
    options: dict[str, Any] = {}
    if isinstance(value, str):
        name, body = value, None
    elif isinstance(value, LMap):
        if "style" not in value:
            errs.add(f"a rule mapping needs 'style:' (one of {', '.join(STYLES)})", loc)
            return None
        name, body = value["style"], value
        loc = value.value_loc("style")
    else:
        errs.add(f"a rule is a style name or a mapping with 'style:', got {describe(value)}", loc)
        return None
    if not isinstance(name, str) or name not in names:
        errs.add(f"unknown style '{name}'{nearest(str(name), names)}; styles are: "
                 f"{', '.join(names)}", loc)
        return None
    if name in ALIASES:
        name, preset = ALIASES[name]
        options.update(preset)
    allowed = STYLES[name]
    for key, v in (body or {}).items():
        if key == "style":
            continue
        if key not in allowed:
            valid = ", ".join(allowed) or "none"
            errs.add(f"style '{name}' has no option '{key}'{nearest(key, allowed)}; its options: "
                     f"{valid}", body.key_loc(key))
            continue
        options[key] = _parse_option(allowed[key], v, body.value_loc(key), key, errs)
    for key in REQUIRED.get(name, ()):
        if key not in options:
            errs.add(f"style '{name}' needs '{key}'", loc)
    _check_pairs(name, options, body, loc, errs)
    return StyleSpec(name, options)


PAIRS = (("input_layouts", "desired_input_layouts"),
         ("input_kwarg_layouts", "desired_input_kwarg_layouts"),
         ("output_layouts", "desired_output_layouts"))


def _check_pairs(name: str, options: dict, body: Any, loc: Loc, errs: ErrorList) -> None:
    """prepare_* styles convert each layout into its desired one: the two must line up."""
    if not name.startswith("prepare_"):
        return
    for have, want in PAIRS:
        if (have in options) != (want in options):
            given, missing = (have, want) if have in options else (want, have)
            where = body.key_loc(given) if isinstance(body, LMap) else loc
            errs.add(f"style '{name}' has '{given}' but no '{missing}': each layout needs the "
                     "one it is converted to", where)
            continue
        if have not in options:
            continue
        a, b = options[have], options[want]
        where = body.value_loc(want) if isinstance(body, LMap) else loc
        if isinstance(a, dict) and isinstance(b, dict) and a.keys() != b.keys():
            errs.add(f"'{have}' and '{want}' name different keywords: {sorted(a)} vs {sorted(b)}",
                     where)
        elif isinstance(a, list) != isinstance(b, list) or \
                (isinstance(a, list) and len(a) != len(b)):
            n = lambda v: f"a list of {len(v)}" if isinstance(v, list) else "one layout"  # noqa: E731
            errs.add(f"'{have}' is {n(a)} but '{want}' is {n(b)}; give one entry per input, "
                     "null for inputs left alone", where)


def parse_rules(doc: LMap, errs: ErrorList) -> list[Rule]:
    section = doc.get("tensor_parallel")
    if section is None:
        return []
    if not isinstance(section, LMap):
        errs.add("'tensor_parallel' maps module patterns to styles", doc.value_loc("tensor_parallel"))
        return []
    rules = []
    for pattern, value in section.items():
        key_loc = section.key_loc(pattern)
        try:
            compile_pattern(pattern)
        except ValueError as e:
            errs.add(f"bad pattern '{pattern}': {e}", key_loc)
            continue
        style = parse_style(value, section.value_loc(pattern), errs)
        if style is not None:
            rules.append(Rule(str(pattern), style, key_loc))
    return rules
