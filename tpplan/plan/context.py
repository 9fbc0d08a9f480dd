"""``context_parallel:`` — the section's spec and parser (docs/long-context.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import ErrorList, Loc, nearest
from .reader import Reader
from .yamlio import LMap

__all__ = ["CP_METHODS", "ContextParallelSpec", "parse_context_parallel"]

CP_METHODS = ("ring", "ulysses")


@dataclass
class ContextParallelSpec:
    """``context_parallel:`` — how attention runs on a sequence split over ``mesh.cp`` ranks.

    ``ring``: each rank's queries against the K/V of the whole sequence, all-gathered over
    cp (the Llama 3 paper's form); ``ulysses``: an all-to-all from sequence shards to head
    shards around attention. ``load_balance``: each rank holds a head and a tail chunk of
    the sequence, so causal attention costs every rank the same."""

    method: str = "ring"
    load_balance: bool = True
    loc: Loc | None = None
    locs: dict[str, Loc] = field(default_factory=dict)

    def chunks(self, cp: int) -> int:
        """How many equal pieces the sequence is cut into: 2·cp with load balancing."""
        return 2 * cp if self.load_balance else cp


def parse_context_parallel(doc: LMap, errs: ErrorList) -> ContextParallelSpec:
    """``context_parallel: ring|ulysses|{method: ring, load_balance: true}``; read at any
    ``mesh.cp`` (at cp 1 it changes nothing, so a plan can set cp with ``--set``)."""
    key = "context_parallel"
    value = doc.get(key)
    if isinstance(value, str):  # the method by itself; a wrong one is reported below
        loc = doc.value_loc(key)
        value = LMap(loc)
        value.put("method", doc[key], loc, loc)
    r = Reader.section(errs, doc, key, ("method", "load_balance"), value)
    spec = ContextParallelSpec(method=r.get("method", str, "ring"),
                               load_balance=r.get("load_balance", bool, True),
                               loc=doc.key_loc(key) if key in doc else None, locs=r.locs())
    if spec.method not in CP_METHODS:
        errs.add(f"'context_parallel.method' must be one of {', '.join(CP_METHODS)}, got "
                 f"'{spec.method}'{nearest(spec.method, CP_METHODS)}", r.loc("method"))
        spec.method = "ring"
    return spec
