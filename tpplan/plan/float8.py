"""``float8:`` — torchao's float8 training on the linear layers the plan names.

    float8: {linears: ["layers.*.attention.{wq,wk,wv,wo}", "layers.*.feed_forward.*"],
             scaling: rowwise}

``scaling``: ``tensorwise`` (one scale per tensor; FSDP2 then all-gathers the weights in
float8) or ``rowwise`` (a scale per row: closer to bf16's numerics, all-gathers in the
parameter dtype). Parsed with the plan; the device check (float8 needs CUDA with compute
capability 8.9 or more: Ada, Hopper) is :func:`tpplan.parallel.float8.float8_problems`,
made before any process group starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import ErrorList, Loc, nearest
from .patterns import compile_pattern
from .reader import Reader
from .yamlio import LMap, LSeq

__all__ = ["FLOAT8_SCALINGS", "Float8Spec", "parse_float8"]

FLOAT8_SCALINGS = ("tensorwise", "rowwise")


@dataclass
class Float8Spec:
    """The linears (module patterns) trained in float8, and the scaling recipe."""

    linears: list[str] = field(default_factory=list)
    scaling: str = "tensorwise"
    loc: Loc | None = None
    locs: dict[str, Loc] = field(default_factory=dict)


def parse_float8(doc: LMap, errs: ErrorList) -> Float8Spec | None:
    """The section, or None where the plan has none."""
    if doc.get("float8") is None:
        return None
    r = Reader.section(errs, doc, "float8", ("linears", "scaling"))
    spec = Float8Spec(scaling=r.get("scaling", str, "tensorwise"), loc=r.m.loc, locs=r.locs())
    if spec.scaling not in FLOAT8_SCALINGS:
        errs.add(f"'float8.scaling' must be one of {', '.join(FLOAT8_SCALINGS)}, got "
                 f"'{spec.scaling}'{nearest(spec.scaling, FLOAT8_SCALINGS)}", r.loc("scaling"))
    linears = r.m.get("linears") if isinstance(r.m, LMap) else None
    if not isinstance(linears, LSeq) or not linears or not all(isinstance(p, str) for p in linears):
        errs.add("'float8.linears' must be a non-empty list of module patterns (the linear layers "
                 "trained in float8)", r.loc("linears"))
        return spec
    spec.linears = list(linears)
    for i, pattern in enumerate(linears):
        try:
            compile_pattern(pattern)
        except ValueError as e:
            errs.add(f"'float8.linears' pattern {pattern!r}: {e}", linears.item_loc(i))
    return spec
