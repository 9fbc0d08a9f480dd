"""The ``lora`` section as typed data (re-exported by :mod:`tpplan.plan.specs` with the
other sections'); parsed by :mod:`tpplan.plan.lora`."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache

from .errors import Loc
from .patterns import compile_pattern

__all__ = ["LORA_INITS", "LoraSpec", "LoraTarget"]

LORA_INITS = ("kaiming", "gaussian")  # PEFT's init_lora_weights=True and "gaussian"


@dataclass
class LoraTarget:
    """One ``lora.targets`` entry: the linear modules whose path the pattern matches get an
    adapter; ``!pattern`` takes them out again. The last entry that matches decides."""

    pattern: str
    included: bool  # False for a '!pattern' exception
    loc: Loc

    def matches(self, path: str) -> bool:
        """A module path the entry selects. A bare name (no ``.``: ``q_proj``) matches as
        PEFT's ``target_modules`` does -- a module whose path is it or ends with ``.`` + it;
        any other pattern the whole path (tpplan.plan.patterns)."""
        return _regex(self.pattern).fullmatch(path) is not None


@lru_cache(maxsize=1024)
def _regex(pattern: str) -> re.Pattern:
    whole = compile_pattern(pattern)
    if "." in pattern or pattern.startswith("re:"):
        return whole
    return re.compile(rf"(?:.*\.)?(?:{whole.pattern})")


@dataclass
class LoraSpec:
    """``lora:`` — low-rank adapters beside frozen linear layers (PEFT's LoRA): the output
    of each target becomes ``base(x) + B(A(dropout(x))) * alpha / rank`` (``alpha /
    sqrt(rank)`` with ``rslora``). Every other parameter is frozen except the modules in
    ``modules_to_save``, which train whole (a new head, say)."""

    targets: list[LoraTarget] = field(default_factory=list)
    rank: int = 8
    alpha: float = 8.0
    dropout: float = 0.0
    init: str = "kaiming"  # A kaiming-uniform(a=sqrt 5), B zeros; "gaussian": A normal(1/rank)
    rslora: bool = False
    modules_to_save: list[LoraTarget] = field(default_factory=list)
    loc: Loc | None = None
    locs: dict[str, Loc] = field(default_factory=dict)

    @property
    def scaling(self) -> float:
        return self.alpha / (self.rank ** 0.5 if self.rslora else self.rank)
