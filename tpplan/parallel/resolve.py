"""Patterns -> concrete module paths, and every check that needs the model.

Runs on any model, meta-device ones included, without a process group: a plan that does
not fit is reported with its lines before any collective could hang on it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn

from ..plan.errors import ErrorList, Part, PlanError, PlanErrors, nearest, run_part
from ..plan.patterns import compile_pattern, generalize
from ..plan.pipeline import split_reads
from ..plan.specs import AttrRule, PlanSpec, Rule, Unit
from ..plan.styles import PACKED_STYLES, SHARDING_STYLES, ep_borrows_tp
from .context.sequence import check_context_parallel
from .experts.style import check_aux_loss, check_experts, expert_tp_inside_ep
from .tp.checks import check_composite, check_heads, check_latent, check_norms_beside_colwise, check_whole_model
from .freeze import check_freeze
from .tp.head_params import check_head_params
from .tp.kv_heads import check_kv_colwise
from .lora.adapters import check_lora
from .tp.packed import check_packed
from .tp.tied import check_tied_across_stages
from .mesh import ParallelDims
from .pipeline.split import PipelineSplit, split_stages
from .tp.sharding import SHARD_DIMS, check_sharding, shard_dims

__all__ = ["Resolution", "resolve", "match_modules", "AC_BLOCKS", "SHARD_DIMS", "shard_dims"]

AC_BLOCKS = "activation checkpointing blocks"  # what checkpointing's patterns are called
WHOLE_MODULE_STYLES = ("sequence_parallel", "replicate")  # they claim every parameter below


@dataclass
class Resolution:
    """What a plan means for one model at one world size."""

    dims: ParallelDims | None
    errors: ErrorList = field(default_factory=ErrorList)
    rules: list[tuple[Rule, list[str]]] = field(default_factory=list)
    rule_of: dict[str, Rule] = field(default_factory=dict)  # module path -> its rule
    attrs: list[tuple[AttrRule, list[tuple[str, int]]]] = field(default_factory=list)
    units: list[tuple[Unit, list[str]]] = field(default_factory=list)
    ac_blocks: list[str] = field(default_factory=list)
    compile_blocks: list[str] = field(default_factory=list)
    stage: bool = False  # resolved on one pipeline stage: patterns may match nothing here
    pipeline: PipelineSplit | None = None  # the stages, when the plan has a pipeline

    @property
    def ok(self) -> bool:
        return not self.errors


def _match(pattern: str, paths: list[str]) -> list[str]:
    rx = compile_pattern(pattern)
    return [p for p in paths if rx.fullmatch(p)]


def _no_match(pattern: str, what: str, paths: list[str], params: set[str]) -> str:
    if any(compile_pattern(pattern).fullmatch(p) for p in params):
        return (f"{what} '{pattern}' names a parameter, not a module; "
                f"write the module path ('{pattern.rpartition('.')[0]}')")
    candidates = sorted({generalize(p) for p in paths if p})
    return f"{what} '{pattern}' matches no module of the model{nearest(pattern, candidates, 0.5)}"


def _resolve_rules(plan: PlanSpec, res: Resolution, paths: list[str], modules: dict, params: set[str],
                   tp: int, part: Part) -> None:
    def match(errs: ErrorList) -> tuple[list, dict]:  # reads tp
        out = _scratch(res, errs)
        for rule in plan.rules:
            hits = _match(rule.pattern, paths)
            out.rules.append((rule, hits))
            if not hits and not out.stage:
                errs.add(_no_match(rule.pattern, "pattern", paths, params), rule.loc)
            for path in hits:
                other = out.rule_of.get(path)
                if other is not None:
                    errs.add(f"module '{path}' is matched by two rules: '{other.pattern}' (line {other.loc.line}) and "
                             f"'{rule.pattern}' (line {rule.loc.line}){expert_tp_inside_ep(other, rule)}", rule.loc)
                    continue
                out.rule_of[path] = rule
                module, parent = modules[path], modules.get(path.rpartition(".")[0])
                if rule.style.name in SHARDING_STYLES:
                    check_sharding(rule, path, module, tp, errs)
                    check_composite(rule, path, module, errs)
                    check_heads(rule, path, module, parent, tp, errs)
                elif rule.style.name in PACKED_STYLES:
                    check_packed(rule, path, module, parent, tp, errs)
                elif rule.style.name == "mla_kv_a_proj":
                    check_latent(rule, path, module, parent, errs)
                elif rule.style.name == "kv_colwise":
                    check_kv_colwise(rule, path, module, parent, tp, errs)
        check_norms_beside_colwise(out, modules)
        return out.rules, out.rule_of

    def experts(errs: ErrorList) -> None:  # reads tp, mesh.ep and the rules matched
        out = _scratch(res, errs)
        out.rules, out.rule_of = res.rules, res.rule_of
        check_experts(plan.mesh, out, modules)
        check_head_params(out, modules, tp)
        for path, rule in out.rule_of.items():
            if rule.style.name not in WHOLE_MODULE_STYLES:
                continue
            for inner, other in out.rule_of.items():
                if inner.startswith(path + ".") and other.style.name in SHARDING_STYLES:
                    errs.add(f"rule '{rule.pattern}' ({rule.style.name}) replicates every parameter "
                             f"under '{path}', but rule '{other.pattern}' (line {other.loc.line}) "
                             f"shards '{inner}' inside it", rule.loc)
                    break

    res.rules, res.rule_of = part(("rules", tp), res.errors, match)
    check_aux_loss(plan.mesh, modules.get(""), res.errors)  # reads pp and cp
    part(("experts", tp, plan.mesh.ep), res.errors, experts)


def _resolve_attrs(plan: PlanSpec, res: Resolution, paths: list[str], modules: dict, params: set[str],
                   tp: int) -> list:
    for attr_rule in plan.divide_by_tp:
        hits = _match(attr_rule.pattern, paths)
        found: list[tuple[str, int]] = []
        res.attrs.append((attr_rule, found))
        if not hits and not res.stage:
            res.errors.add("divide_by_tp: " + _no_match(attr_rule.pattern, "module pattern", paths,
                                                        params), attr_rule.loc)
        for path in hits:
            module = modules[path]
            name = attr_rule.attribute
            if not hasattr(module, name):
                ints = [k for k, v in vars(module).items() if isinstance(v, int)]
                res.errors.add(f"divide_by_tp: module '{path}' ({type(module).__name__}) has no "
                               f"attribute '{name}'{nearest(name, ints)}", attr_rule.loc)
                continue
            value = getattr(module, name)
            if not isinstance(value, int) or isinstance(value, bool):
                res.errors.add(f"divide_by_tp: '{path}.{name}' is a {type(value).__name__}, "
                               "not an integer", attr_rule.loc)
            elif value % tp:
                res.errors.add(f"divide_by_tp: '{path}.{name}' = {value} is not divisible by "
                               f"tp={tp}", attr_rule.loc)
            else:
                found.append((path, value))
    return res.attrs


def _no_forward(pattern: str, paths: list[str], modules: dict, what: str) -> str | None:
    """The error for a pattern that matches a container without a ``forward`` of its own (a
    ``ModuleList``): its parent calls the children one by one, so hooks or a wrapped forward
    on the container never run."""
    bare = [p for p in paths if type(modules[p]).forward is nn.Module.forward]
    if not bare:
        return None
    path = bare[0]
    return (f"{what} '{pattern}' matches '{path or '<root>'}', a {type(modules[path]).__name__} "
            f"with no forward of its own (its parent calls each child), so {NO_FORWARD[what]}; "
            f"write '{pattern}.*' for each child")


def match_modules(pattern: str, what: str, kind: str, loc, modules: dict, params: set[str],
                  stage: bool, errs: ErrorList) -> list[str]:
    """What ``pattern`` matches; no match (off a stage) or a forward-less container: at ``loc``."""
    paths = list(modules)
    hits = _match(pattern, paths)
    if not hits and not stage:
        errs.add(_no_match(pattern, kind, paths, params), loc)
    if bare := _no_forward(pattern, hits, modules, what):
        errs.add(bare, loc)
    return hits


NO_FORWARD = {"FSDP unit pattern": "FSDP2 cannot shard it",
              AC_BLOCKS: "checkpointing it would never run",
              "compile blocks": "compiling it would never run"}


def _resolve_units(plan: PlanSpec, res: Resolution, modules: dict, params: set[str]) -> list:
    owner: dict[str, int] = {}
    for i, unit in enumerate(plan.fsdp.units):
        hits: list[str] = []
        for pattern in unit.patterns:
            got = match_modules(pattern, "FSDP unit pattern", "FSDP unit pattern", unit.loc,
                                modules, params, res.stage, res.errors)
            hits += [p for p in got if p not in hits]
        for path in hits:
            if path in owner:
                first = plan.fsdp.units[owner[path]]
                res.errors.add(f"module '{path}' is in two FSDP units ({first.loc.line}:"
                               f"{first.loc.column} and {unit.loc.line}:{unit.loc.column})", unit.loc)
            owner[path] = i
        res.units.append((unit, hits))
    return res.units


def resolve(plan: PlanSpec, model: nn.Module, world_size: int, stage: bool = False,
            part: Part = run_part) -> Resolution:
    """Resolve ``plan`` against ``model`` at ``world_size``; errors are collected, not raised.

    ``stage``: ``model`` is one pipeline stage of the model the plan was checked against,
    so a pattern matching nothing here (the embedding's rule on a middle stage) is fine.
    ``part``: each part through it (:data:`tpplan.plan.errors.Part`: ``search`` caches them
    across its variants of one plan, the model and its other sections being the cache's own).

    Checked: the mesh against the world size, every pattern of every section against the
    model's modules, each sharded dimension, divided attribute and experts module against
    tp and ep (the batch is :func:`tpplan.plan.step_shape`'s check, not apply's)."""
    errs = ErrorList()
    try:
        dims = ParallelDims.of(plan.mesh, world_size, ep_borrows_tp(plan.rules))
    except PlanErrors as e:
        errs.extend(e.errors)
        dims = None
    res = Resolution(dims=dims, errors=errs, stage=stage)
    modules, paths, params = part(("model",), errs, lambda _: _named(model))
    tp = dims.tp if dims else plan.mesh.tp
    _resolve_rules(plan, res, paths, modules, params, tp, part)
    res.attrs = part(("attrs", tp), errs, lambda e: _resolve_attrs(
        plan, _scratch(res, e), paths, modules, params, tp))
    if plan.fsdp is not None:
        res.units = part(("units",), errs, lambda e: _resolve_units(
            plan, _scratch(res, e), modules, params))
    elif dims is not None and dims.dp > 1:
        errs.add(f"the mesh has {dims.dp} data-parallel ranks but the plan has no 'fsdp' section, "
                 "so gradients would never be averaged; add 'fsdp: {units: [...]}' (or 'fsdp: {}' "
                 "to shard at the root only)", plan.mesh.loc)
    for blocks, name, what in ((plan.activation_checkpointing, "ac_blocks", AC_BLOCKS),
                               (plan.compile, "compile_blocks", "compile blocks")):
        if blocks.enabled:  # a list of its own: the caller may change it
            setattr(res, name, list(part((what, blocks.blocks), errs, lambda e, b=blocks, w=what:
                                         match_modules(b.blocks, w, "blocks pattern", b.loc,
                                                       modules, params, stage, e))))
    if plan.compile.enabled is None:  # left out: compiled on CUDA where the blocks are found
        quiet = ErrorList()
        hits = match_modules(plan.compile.blocks, "compile blocks", "blocks pattern", None, modules,
                             params, stage, quiet)
        res.compile_blocks = [] if quiet else hits
    part(("lora", tp), errs, lambda e: check_lora(plan.lora, modules, res.rule_of, stage, e))
    if not stage:  # whole-model checks: a stage holds part of what they look at
        part(("cp", tp, plan.mesh.cp), errs, lambda e: check_context_parallel(plan, model, tp, e))
        part(("whole", tp), errs, lambda e: check_whole_model(plan, _scratch(res, e, True), model,
                                                              modules))
        part(("freeze",), errs, lambda e: check_freeze(plan.freeze, model, e))
    if plan.pipeline is not None and not stage:
        pp = dims.pp if dims else plan.mesh.pp
        res.pipeline = part(("split", *split_reads(plan.pipeline, pp)), errs,
                            lambda e: _split(model, plan, pp, e))
    res.errors = _collapse_repeats(errs)
    return res


def _named(model: nn.Module) -> tuple[dict, list[str], set[str]]:
    modules = dict(model.named_modules())
    return modules, list(modules), {n for n, _ in model.named_parameters()}


def _scratch(res: Resolution, errs: ErrorList, matched: bool = False) -> Resolution:
    """A blank resolution like ``res`` collecting one part's errors in ``errs``; ``matched``:
    with the rules and units ``res`` resolved so far."""
    out = Resolution(dims=res.dims, errors=errs, stage=res.stage)
    if matched:
        out.rules, out.rule_of, out.units = res.rules, res.rule_of, res.units
    return out


def _split(model: nn.Module, plan: PlanSpec, pp: int, errs: ErrorList) -> PipelineSplit:
    split = split_stages(model, plan, pp)
    errs.extend(split.errors)
    check_tied_across_stages(split, model, plan.pipeline.loc, errs)
    return split


def _collapse_repeats(errs: ErrorList) -> ErrorList:
    """One error per rule for a mistake repeated in every block, not 80 identical lines."""
    groups: dict[tuple, list] = {}
    for e in errs:
        groups.setdefault((e.loc, generalize(e.message)), []).append(e)
    out = ErrorList()
    for same in groups.values():
        first = same[0]
        if len(same) > 1:
            first = PlanError(f"{first.message} (and {len(same) - 1} more modules like it)",
                              first.loc)
        out.append(first)
    return out
