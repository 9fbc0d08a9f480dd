"""The ``lora`` section -> a :class:`~tpplan.plan.specs.LoraSpec`, mistakes located.

Syntax, types and ranges only; whether a target matches a linear layer, and whether the
rank fits it, needs the model (:mod:`tpplan.parallel.lora.adapters`).
"""

from __future__ import annotations

from .errors import ErrorList, nearest
from .patterns import compile_pattern
from .reader import Reader
from .lora_spec import LORA_INITS, LoraSpec, LoraTarget
from .yamlio import LMap, LSeq

__all__ = ["parse_lora"]

KEYS = ("targets", "rank", "alpha", "dropout", "init", "rslora", "modules_to_save")


def _patterns(r: Reader, key: str, what: str) -> list[LoraTarget]:
    """A list of module patterns, ``!pattern`` an exception (one pattern alone is a list)."""
    value = r.m.get(key)
    if value is None:
        return []
    if isinstance(value, str):
        items = [(value, r.loc(key))]
    elif isinstance(value, LSeq):
        items = [(v, value.item_loc(i)) for i, v in enumerate(value)]
    else:
        r.errs.add(f"'lora.{key}' must be a list of {what}, got {value!r}", r.loc(key))
        return []
    out = []
    for item, loc in items:
        if not isinstance(item, str):
            r.errs.add(f"'lora.{key}' entries are module patterns (strings), got {item!r}", loc)
            continue
        included = not item.startswith("!")
        pattern = item if included else item[1:]
        try:
            compile_pattern(pattern)
        except ValueError as e:
            r.errs.add(f"'lora.{key}' pattern '{item}': {e}", loc)
            continue
        out.append(LoraTarget(pattern, included, loc))
    if out and not any(t.included for t in out):
        r.errs.add(f"'lora.{key}' has only '!' exceptions: nothing is selected", r.loc(key))
    return out


def parse_lora(doc: LMap, errs: ErrorList) -> LoraSpec | None:
    """``lora: {targets: [...], rank: 16, alpha: 32, dropout: 0.05, init: kaiming,
    rslora: false, modules_to_save: [lm_head]}``; None when the plan has no ``lora``."""
    if doc.get("lora") is None:
        return None
    r = Reader.section(errs, doc, "lora", KEYS)
    d = LoraSpec()
    rank = r.get("rank", int, d.rank)
    spec = LoraSpec(
        targets=_patterns(r, "targets", "module patterns of linear layers"),
        rank=rank, alpha=r.number("alpha", float(rank)), dropout=r.number("dropout", d.dropout),
        init=r.get("init", str, d.init), rslora=r.get("rslora", bool, d.rslora),
        modules_to_save=_patterns(r, "modules_to_save", "module patterns"),
        loc=doc.key_loc("lora"), locs=r.locs())
    if "targets" not in r.m and isinstance(r.m, LMap):
        errs.add("'lora' needs 'targets': the linear layers that get adapters, e.g. "
                 "[\"model.layers.*.self_attn.{q_proj,v_proj}\"]", spec.loc)
    if spec.rank < 1:
        errs.add(f"'lora.rank' must be at least 1, got {spec.rank}", r.loc("rank"))
        spec.rank = 1
    if not 0.0 <= spec.dropout < 1.0:
        errs.add(f"'lora.dropout' must be in [0, 1), got {spec.dropout}", r.loc("dropout"))
        spec.dropout = 0.0
    if spec.init not in LORA_INITS:
        errs.add(f"'lora.init' must be one of {', '.join(LORA_INITS)} (PEFT's default and "
                 f"'gaussian'), got '{spec.init}'{nearest(spec.init, LORA_INITS)}",
                 r.loc("init"))
        spec.init = d.init
    return spec
