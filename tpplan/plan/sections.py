"""The plan document -> a :class:`~tpplan.plan.specs.PlanSpec`, every mistake collected
with its place.

Only syntax, types and ranges are checked here; whether a pattern matches the model, and
whether shapes divide, is for :mod:`tpplan.parallel.resolve`, which needs the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .context import parse_context_parallel
from .fault_tolerance import fault_tolerance_section
from .errors import ErrorList, Loc, Part, PlanError, PlanErrors, nearest, run_part
from .patterns import compile_pattern
from .lora import parse_lora
from .pipeline import parse_pipeline
from .reader import Reader
from .rules import parse_rules
from .specs import (
    DEFAULT_BLOCKS, DTYPES, ACSpec, AttrRule, CompileSpec, FreezeRule, FSDPSpec, MeshSpec, ModelSpec,
    PlanSpec, Unit,
)
from .trainer import (
    TRAINER_SECTIONS, parse_checkpoint, parse_data, parse_eval, parse_metrics, parse_train,
)
from .float8 import parse_float8
from .yamlio import LMap, LSeq

__all__ = ["TOP_LEVEL", "parse_plan", "parse_model", "require_model"]

TOP_LEVEL = (
    "extends", "mesh", "model", "tensor_parallel", "loss_parallel", "divide_by_tp", "fsdp",
    "activation_checkpointing", "compile", "freeze", "lora", "pipeline", "context_parallel",
    "fault_tolerance", "float8", *TRAINER_SECTIONS,
)
AC_MODES = ("none", "full", "selective", "op")


def parse_mesh(doc: LMap, errs: ErrorList) -> MeshSpec:
    r = Reader.section(errs, doc, "mesh", ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep"))
    d = MeshSpec()
    spec = MeshSpec(r.get("tp", int, d.tp), r.get("dp_shard", int, d.dp_shard),
                    r.get("dp_replicate", int, d.dp_replicate), r.get("pp", int, d.pp),
                    cp=r.get("cp", int, d.cp), ep=r.get("ep", int, d.ep),
                    loc=doc.key_loc("mesh") if "mesh" in doc else doc.loc, locs=r.locs())
    r.at_least("tp", spec.tp, 1)
    r.at_least("cp", spec.cp, 1)
    r.at_least("pp", spec.pp, 1)
    r.at_least("ep", spec.ep, 1)
    r.at_least("dp_replicate", spec.dp_replicate, 1)
    if spec.dp_shard == 0 or spec.dp_shard < -1:
        errs.add(f"'mesh.dp_shard' must be at least 1, or -1 for the ranks left over, got "
                 f"{spec.dp_shard}", r.loc("dp_shard"))
    return spec


def parse_model(doc: LMap, errs: ErrorList) -> ModelSpec | None:
    if doc.get("model") is None:
        return None
    r = Reader(errs, "model", doc["model"], doc.value_loc("model"),
               ("name", "config", "factory", "kwargs", "hf", "hf_config", "pretrained", "adapter"))
    hf = r.get("hf", str, None)
    spec = ModelSpec(name=r.get("name", str, None), factory=r.get("factory", str, None),
                     hf=hf, hf_config=r.get("hf_config", str, None), loc=doc.key_loc("model"),
                     locs=r.locs(), base_dir=str(Path(doc.loc.file).parent),
                     pretrained=r.get("pretrained", str, None, "an HF checkpoint folder"),
                     adapter=r.get("adapter", str, None, "a PEFT adapter folder"))
    if spec.pretrained and not (spec.name or spec.factory or spec.hf_config):
        spec.hf_config = spec.pretrained  # an HF model: its config.json is in the folder
        spec.locs.setdefault("hf_config", spec.locs["pretrained"])
    if hf or spec.hf_config:  # config: the HF config's fields (over hf_config's file)
        fields = r.get("config", LMap, LMap(r.m.loc), "a mapping of HF config fields")
        spec.hf_kwargs = dict(fields)
        spec.locs.update({f"config.{k}": fields.value_loc(k) for k in fields})
    else:
        spec.config = r.get("config", str, None, "a config name such as debug or 70b")
    kwargs = r.get("kwargs", LMap, LMap(r.m.loc))
    spec.kwargs = dict(kwargs)
    spec.locs.update({f"kwargs.{k}": kwargs.value_loc(k) for k in kwargs})  # builders' errors
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


def parse_divide_by_tp(doc: LMap, errs: ErrorList) -> list[AttrRule]:
    out = []
    for item, loc in _items(doc, "divide_by_tp", errs, "'divide_by_tp' is a list of attribute "
                            "paths such as layers.*.attention.n_heads"):
        if not isinstance(item, str) or "." not in item:
            errs.add(f"'{item}' is not an attribute path (module.path.attribute)", loc)
            continue
        module, _, attr = item.rpartition(".")
        if _pattern_ok(module, f"bad pattern '{module}'", loc, errs):
            out.append(AttrRule(module, attr, loc))
    return out


def _items(doc: LMap, key: str, errs: ErrorList, what: str):
    """``(item, loc)`` of the list at ``key`` (nothing if absent; an error if not a list)."""
    value = doc.get(key)
    if value is None:
        return
    if not isinstance(value, LSeq):
        errs.add(f"{what}, got {value!r}", doc.value_loc(key))
        return
    for i, item in enumerate(value):
        yield item, value.item_loc(i)


def _pattern_ok(pattern: str, what: str, loc, errs: ErrorList) -> bool:
    try:
        compile_pattern(pattern)
        return True
    except ValueError as e:
        errs.add(f"{what}: {e}", loc)
        return False


def _dtype(r: Reader, key: str) -> str | None:
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
    r = Reader(errs, "fsdp", value, doc.value_loc("fsdp"),
               ("units", "reshard_after_forward", "mixed_precision", "cpu_offload"))
    spec = FSDPSpec(reshard_after_forward=r.get("reshard_after_forward", bool, True),
                    cpu_offload=r.get("cpu_offload", bool, False), loc=doc.key_loc("fsdp"))
    mp = r.get("mixed_precision", LMap, None)
    if mp is not None:
        mr = Reader(errs, "fsdp.mixed_precision", mp, r.loc("mixed_precision"),
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


def _section(doc: LMap, key: str, errs: ErrorList, allowed: tuple, shorthand: dict) -> Reader:
    """A section that may also be written as one word (``compile: true``, ``ac: full``)."""
    value = doc.get(key)
    if isinstance(value, (bool, str)) and value in shorthand:  # True == 1: bools only here
        loc = doc.value_loc(key)
        value = LMap(loc)
        for k, v in shorthand[doc[key]].items():
            value.put(k, v, loc, loc)
    return Reader.section(errs, doc, key, allowed, value)


def parse_ac(doc: LMap, errs: ErrorList) -> ACSpec:
    """``activation_checkpointing: none|full|op|{mode: selective, every: 2, blocks: ...}``."""
    key = "activation_checkpointing"
    words = {False: {"mode": "none"}, True: {"mode": "full"}}
    if isinstance(doc.get(key), str):  # a mode by itself; a wrong one is reported below
        words[doc[key]] = {"mode": doc[key]}
    r = _section(doc, key, errs, ("mode", "every", "blocks"), words)
    spec = ACSpec(mode=r.get("mode", str, "none" if doc.get(key) is None else "full"),
                  every=r.get("every", int, 1), blocks=r.get("blocks", str, DEFAULT_BLOCKS),
                  loc=r.m.loc)
    if spec.mode not in AC_MODES:
        errs.add(f"'activation_checkpointing' mode must be one of {', '.join(AC_MODES)}, got "
                 f"'{spec.mode}'{nearest(spec.mode, AC_MODES)}", r.loc("mode"))
        spec.mode = "none"
    if "every" in r.m and spec.mode != "selective":
        errs.add(f"'activation_checkpointing.every' applies to mode selective only (mode is "
                 f"{spec.mode}: {'every block' if spec.mode == 'full' else 'no block'})",
                 r.loc("every"))
        spec.every = 1
    elif spec.every < 1:
        errs.add(f"'activation_checkpointing.every' must be at least 1, got {spec.every}",
                 r.loc("every"))
        spec.every = 1
    return spec


def parse_compile(doc: LMap, errs: ErrorList) -> CompileSpec:
    """``compile: true|false|{enabled: true, blocks: ..., fullgraph: false}``; left out: None (on CUDA)."""
    r = _section(doc, "compile", errs, ("enabled", "blocks", "fullgraph"),
                 {False: {"enabled": False}, True: {"enabled": True}})
    return CompileSpec(enabled=r.get("enabled", bool, True if doc.get("compile") is not None else None),
                       blocks=r.get("blocks", str, DEFAULT_BLOCKS),
                       fullgraph=r.get("fullgraph", bool, False), loc=r.m.loc)


def check_top_level(doc: LMap, errs: ErrorList) -> bool:
    """Unknown sections and ``loss_parallel``; returns ``loss_parallel``."""
    for key in doc:
        if key not in TOP_LEVEL:
            errs.add(f"unknown section '{key}'{nearest(str(key), TOP_LEVEL)}; sections are: "
                     f"{', '.join(TOP_LEVEL)}", doc.key_loc(key))
    lp = doc.get("loss_parallel", False)
    if not isinstance(lp, bool):
        errs.add(f"'loss_parallel' must be true or false, got {lp!r}", doc.value_loc("loss_parallel"))
    return lp is True


def parse_plan(doc: LMap, source: str = "<plan>", part: Part = run_part) -> PlanSpec:
    """Parse every section; :class:`~tpplan.plan.errors.PlanErrors` lists every mistake.
    Each section through ``part`` keyed ``("section", *the document's keys it reads)``."""
    errs = ErrorList()

    def one(key: str, parser) -> Any:
        return part(("section", key), errs, lambda e: parser(doc, e))
    spec = PlanSpec(
        source=source,
        loss_parallel=check_top_level(doc, errs),
        mesh=one("mesh", parse_mesh),
        model=one("model", parse_model),
        rules=one("tensor_parallel", parse_rules),
        divide_by_tp=one("divide_by_tp", parse_divide_by_tp),
        fsdp=one("fsdp", parse_fsdp),
        activation_checkpointing=one("activation_checkpointing", parse_ac),
        compile=one("compile", parse_compile),
        train=one("train", parse_train),
        data=one("data", parse_data),
        eval=one("eval", parse_eval),
        checkpoint=one("checkpoint", parse_checkpoint),
        metrics=one("metrics", parse_metrics),
        freeze=one("freeze", parse_freeze),
        lora=one("lora", parse_lora),
        context_parallel=one("context_parallel", parse_context_parallel),
        float8=one("float8", parse_float8),
    )
    spec.pipeline = part(("section", "pipeline", "mesh", "compile"), errs, lambda e: parse_pipeline(
        doc, spec.mesh, spec.compile.enabled, e))
    spec.fault_tolerance = part(("section", "fault_tolerance", "mesh"), errs, lambda e: fault_tolerance_section(
        doc, spec.mesh, e))
    if spec.model is not None and spec.model.adapter and spec.lora is None:
        errs.add("model.adapter starts LoRA adapters from a PEFT folder: the plan needs a "
                 "'lora' section (its targets, rank and alpha as the adapter's)",
                 spec.model.locs["adapter"])
    errs.raise_if_any()
    return spec


def parse_freeze(doc: LMap, errs: ErrorList) -> list[FreezeRule]:
    """``freeze: [pattern, '!pattern', ...]``: parameter or module paths, ``!`` to exempt."""
    out = []
    for item, loc in _items(doc, "freeze", errs, "'freeze' must be a list of parameter or "
                            "module patterns"):
        if not isinstance(item, str):
            errs.add(f"'freeze' entries are patterns (strings), got {item!r}", loc)
            continue
        frozen = not item.startswith("!")
        pattern = item if frozen else item[1:]
        if _pattern_ok(pattern, f"'freeze' pattern '{item}'", loc, errs):
            out.append(FreezeRule(pattern, frozen, loc))
    return out


def require_model(spec: PlanSpec) -> ModelSpec:
    """The ``model`` section, for a command that builds the model from it. A plan may leave
    it out (``tpplan.load(...).apply(my_model, mesh)`` brings its own model); a command
    that needs one says so at the plan's first line."""
    if spec.model is None:
        raise PlanErrors([PlanError(
            "the plan has no 'model' section; this command builds the model from it (model: "
            "{name: llama3}, {factory: 'package.module:function'}, {hf: ...} or "
            "{hf_config: ...})", Loc(spec.source, 1, 1))])
    return spec.model
