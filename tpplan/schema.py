"""The plan document -> typed sections, every mistake collected with its place.

Only syntax and types are checked here; whether a pattern matches the model, and whether
shapes divide, is for :mod:`tpplan.resolve`, which needs the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ErrorList, Loc, nearest
from .patterns import compile_pattern
from .styles import ALIASES, BOOL, INT, KWARG_LAYOUTS, LAYOUT, LAYOUTS, REQUIRED, STYLES, StyleSpec
from .styles import LAYOUT_WORDS, parse_layout
from .yamlio import LMap, LSeq

TRAINER_SECTIONS = ("train", "data", "checkpoint", "metrics")
TOP_LEVEL = (
    "extends", "mesh", "model", "tensor_parallel", "loss_parallel", "divide_by_tp", "fsdp",
    "activation_checkpointing", "compile", *TRAINER_SECTIONS,
)
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}
AC_MODES = ("none", "full", "selective")
DEFAULT_BLOCKS = "layers.*"


@dataclass
class MeshSpec:
    tp: int = 1
    dp_shard: int = -1
    dp_replicate: int = 1
    loc: Loc | None = None


@dataclass
class ModelSpec:
    """``{name, config}`` for a built-in model, ``{factory, kwargs}`` for a user's own, or
    ``{hf: ClassName, config: {...}}`` / ``{hf_config: path}`` for a HuggingFace model."""

    name: str | None = None
    config: str | None = None
    factory: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    hf: str | None = None
    hf_config: str | None = None
    hf_kwargs: dict[str, Any] = field(default_factory=dict)  # the HF config's fields
    base_dir: str | None = None  # the plan's folder: relative hf_config paths start there
    loc: Loc | None = None
    locs: dict[str, Loc] = field(default_factory=dict)


@dataclass
class Rule:
    """One ``pattern: style`` line of the ``tensor_parallel`` section."""

    pattern: str
    style: StyleSpec
    loc: Loc  # the pattern (the key) in the file

    def __str__(self) -> str:
        return f"'{self.pattern}' (line {self.loc.line})"


@dataclass
class AttrRule:
    """One ``divide_by_tp`` entry: a module pattern and the attribute to divide."""

    pattern: str
    attribute: str
    loc: Loc


@dataclass
class Unit:
    """One entry of ``fsdp.units``. A pattern gives one ``fully_shard`` call per module it
    matches (``layers.*``: one unit per block); a list gives one call for every module its
    patterns match together (``[norm, output]``: one all-gather for both)."""

    patterns: list[str]
    loc: Loc
    grouped: bool = False


@dataclass
class FSDPSpec:
    units: list[Unit] = field(default_factory=list)
    reshard_after_forward: bool = True
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    cpu_offload: bool = False
    loc: Loc | None = None


@dataclass
class BlockSpec:
    """Activation checkpointing (``mode``, ``every``) or compile (``enabled``) per block."""

    mode: str = "none"
    every: int = 1
    blocks: str = DEFAULT_BLOCKS
    fullgraph: bool = False
    loc: Loc | None = None


class _Reader:
    """Typed access to one located mapping, errors collected with their places."""

    def __init__(self, errs: ErrorList, where: str, m: Any, loc: Loc | None, allowed: tuple):
        self.errs, self.where = errs, where
        if m is None:
            m = LMap(loc or Loc("<plan>", 0, 0))
        if not isinstance(m, LMap):
            errs.add(f"'{where}' must be a mapping, got {_kind(m)}", loc)
            m = LMap(loc or Loc("<plan>", 0, 0))
        self.m = m
        for key in m:
            if key not in allowed:
                errs.add(f"unknown key '{key}' in '{where}'{nearest(key, allowed)}; "
                         f"expected one of: {', '.join(allowed)}", m.key_loc(key))

    def loc(self, key: str) -> Loc:
        return self.m.value_loc(key) if key in self.m else self.m.loc

    def get(self, key: str, kind: type | tuple, default: Any, what: str = "") -> Any:
        if key not in self.m or self.m[key] is None:
            return default
        v = self.m[key]
        ok = isinstance(v, kind) and not (kind is int and isinstance(v, bool))
        if kind in (int, (int,)) and isinstance(v, bool):
            ok = False
        if not ok:
            self.errs.add(f"'{self.where}.{key}' must be {what or _name(kind)}, got {_kind(v)} "
                          f"{v!r}", self.loc(key))
            return default
        return v


def _name(kind: Any) -> str:
    names = {int: "an integer", bool: "true or false", str: "a string", LMap: "a mapping"}
    if isinstance(kind, tuple):
        return " or ".join(names.get(k, k.__name__) for k in kind)
    return names.get(kind, kind.__name__)


def _kind(v: Any) -> str:
    if isinstance(v, LMap):
        return "a mapping"
    if isinstance(v, LSeq):
        return "a list"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            type(None): "null"}.get(type(v), type(v).__name__)


def parse_mesh(doc: LMap, errs: ErrorList) -> MeshSpec:
    r = _Reader(errs, "mesh", doc.get("mesh"), doc.value_loc("mesh") if "mesh" in doc else doc.loc,
                ("tp", "dp_shard", "dp_replicate"))
    spec = MeshSpec(r.get("tp", int, 1), r.get("dp_shard", int, -1), r.get("dp_replicate", int, 1),
                    loc=doc.key_loc("mesh") if "mesh" in doc else doc.loc)
    for key, low in (("tp", 1), ("dp_replicate", 1)):
        if getattr(spec, key) < low:
            errs.add(f"'mesh.{key}' must be at least 1, got {getattr(spec, key)}", r.loc(key))
    if spec.dp_shard == 0 or spec.dp_shard < -1:
        errs.add(f"'mesh.dp_shard' must be at least 1, or -1 for the ranks left over, got "
                 f"{spec.dp_shard}", r.loc("dp_shard"))
    return spec


def parse_model(doc: LMap, errs: ErrorList) -> ModelSpec | None:
    if doc.get("model") is None:
        return None
    r = _Reader(errs, "model", doc["model"], doc.value_loc("model"),
                ("name", "config", "factory", "kwargs", "hf", "hf_config"))
    hf = r.get("hf", str, None)
    spec = ModelSpec(name=r.get("name", str, None), factory=r.get("factory", str, None),
                     hf=hf, hf_config=r.get("hf_config", str, None), loc=doc.key_loc("model"),
                     locs={k: r.loc(k) for k in r.m}, base_dir=str(Path(doc.loc.file).parent))
    if hf or spec.hf_config:  # config: the HF config's fields (over hf_config's file)
        spec.hf_kwargs = dict(r.get("config", LMap, LMap(r.m.loc), "a mapping of HF config fields"))
    else:
        spec.config = r.get("config", str, None, "a config name such as debug or 70b")
    spec.kwargs = dict(r.get("kwargs", LMap, LMap(r.m.loc)))
    sources = [k for k in ("name", "factory", "hf", "hf_config") if getattr(spec, k)]
    if spec.hf and spec.hf_config:
        sources.remove("hf")  # hf_config says the shapes, hf the class to build
    if len(sources) > 1:
        errs.add(f"'model' takes one of name, factory, hf or hf_config; got {' and '.join(sources)}",
                 doc.value_loc("model"))
    elif not sources:
        errs.add("'model' needs 'name' (a built-in model, e.g. llama3), 'factory' "
                 "('package.module:function'), 'hf' (a transformers class) or 'hf_config' "
                 "(a config.json)", doc.value_loc("model"))
    if spec.factory and ":" not in spec.factory:
        errs.add(f"'model.factory' reads 'package.module:function', got '{spec.factory}'",
                 r.loc("factory"))
    return spec


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
        errs.add(f"a rule is a style name or a mapping with 'style:', got {_kind(value)}", loc)
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


def parse_divide_by_tp(doc: LMap, errs: ErrorList) -> list[AttrRule]:
    value = doc.get("divide_by_tp")
    if value is None:
        return []
    if not isinstance(value, LSeq):
        errs.add("'divide_by_tp' is a list of attribute paths such as "
                 "layers.*.attention.n_heads", doc.value_loc("divide_by_tp"))
        return []
    out = []
    for i, item in enumerate(value):
        loc = value.item_loc(i)
        if not isinstance(item, str) or "." not in item:
            errs.add(f"'{item}' is not an attribute path (module.path.attribute)", loc)
            continue
        module, _, attr = item.rpartition(".")
        try:
            compile_pattern(module)
        except ValueError as e:
            errs.add(f"bad pattern '{module}': {e}", loc)
            continue
        out.append(AttrRule(module, attr, loc))
    return out


def _dtype(r: _Reader, key: str) -> str | None:
    v = r.get(key, str, None)
    if v is None:
        return None
    if v not in DTYPES:
        r.errs.add(f"'{r.where}.{key}' must be a dtype, got '{v}'{nearest(v, DTYPES)}; "
                   f"expected one of: {', '.join(DTYPES)}", r.loc(key))
        return None
    return DTYPES[v]


def parse_fsdp(doc: LMap, errs: ErrorList) -> FSDPSpec | None:
    value = doc.get("fsdp")
    if value is None or value is False:
        return None
    if value is True:
        value = LMap(doc.value_loc("fsdp"))
    r = _Reader(errs, "fsdp", value, doc.value_loc("fsdp"),
                ("units", "reshard_after_forward", "mixed_precision", "cpu_offload"))
    spec = FSDPSpec(reshard_after_forward=r.get("reshard_after_forward", bool, True),
                    cpu_offload=r.get("cpu_offload", bool, False), loc=doc.key_loc("fsdp"))
    mp = r.get("mixed_precision", LMap, None)
    if mp is not None:
        mr = _Reader(errs, "fsdp.mixed_precision", mp, r.loc("mixed_precision"),
                     ("param_dtype", "reduce_dtype"))
        spec.param_dtype, spec.reduce_dtype = _dtype(mr, "param_dtype"), _dtype(mr, "reduce_dtype")
    units = r.get("units", LSeq, LSeq(r.m.loc), "a list of patterns")
    for i, entry in enumerate(units):
        loc = units.item_loc(i)
        patterns = list(entry) if isinstance(entry, LSeq) else [entry]
        good = True
        for p in patterns:
            try:
                compile_pattern(p)
            except (ValueError, TypeError) as e:
                errs.add(f"bad FSDP unit pattern '{p}': {e}", loc)
                good = False
        if good:
            spec.units.append(Unit([str(p) for p in patterns], loc, isinstance(entry, LSeq)))
    return spec


def parse_blocks(doc: LMap, key: str, errs: ErrorList) -> BlockSpec:
    """``activation_checkpointing: none|full|{mode: selective, every: 2, blocks: ...}`` and
    ``compile: true|{blocks: ..., fullgraph: false}``."""
    value = doc.get(key)
    loc = doc.value_loc(key) if key in doc else doc.loc
    if key == "compile":
        if value is None or isinstance(value, bool):
            return BlockSpec(mode="full" if value else "none", loc=loc)
        r = _Reader(errs, key, value, loc, ("enabled", "blocks", "fullgraph"))
        enabled = r.get("enabled", bool, True)
        return BlockSpec(mode="full" if enabled else "none", blocks=r.get("blocks", str, DEFAULT_BLOCKS),
                         fullgraph=r.get("fullgraph", bool, False), loc=loc)
    if value is None or value is False:
        return BlockSpec(loc=loc)
    if value is True:
        value = "full"
    if isinstance(value, str):
        value_map = LMap(loc)
        value_map.put("mode", value, loc, loc)
        value = value_map
    r = _Reader(errs, key, value, loc, ("mode", "every", "blocks"))
    spec = BlockSpec(mode=r.get("mode", str, "full"), every=r.get("every", int, 1),
                     blocks=r.get("blocks", str, DEFAULT_BLOCKS), loc=loc)
    if spec.mode not in AC_MODES:
        errs.add(f"'{key}' mode must be one of {', '.join(AC_MODES)}, got '{spec.mode}'"
                 f"{nearest(spec.mode, AC_MODES)}", r.loc("mode"))
        spec.mode = "none"
    if spec.every < 1:
        errs.add(f"'{key}.every' must be at least 1, got {spec.every}", r.loc("every"))
        spec.every = 1
    return spec


def check_top_level(doc: LMap, errs: ErrorList) -> None:
    for key in doc:
        if key not in TOP_LEVEL:
            errs.add(f"unknown section '{key}'{nearest(str(key), TOP_LEVEL)}; sections are: "
                     f"{', '.join(TOP_LEVEL)}", doc.key_loc(key))
    lp = doc.get("loss_parallel", False)
    if not isinstance(lp, bool):
        errs.add(f"'loss_parallel' must be true or false, got {lp!r}", doc.value_loc("loss_parallel"))
    for key in TRAINER_SECTIONS:
        if doc.get(key) is not None and not isinstance(doc[key], LMap):
            errs.add(f"'{key}' must be a mapping, got {_kind(doc[key])}", doc.value_loc(key))
