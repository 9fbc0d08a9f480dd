"""Patterns -> concrete module paths, and every check that needs the model.

Runs on any model, meta-device ones included, without a process group: a plan that does
not fit is reported with its lines before any collective could hang on it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn

from ..plan.errors import ErrorList, PlanError, PlanErrors, nearest
from ..plan.patterns import compile_pattern, generalize
from ..plan.specs import AttrRule, PlanSpec, Rule, Unit
from ..plan.styles import PACKED_STYLES, SHARDING_STYLES, ep_borrows_tp
from .context import check_context_parallel
from .expert_parallel import check_experts, expert_tp_inside_ep
from .checks import check_composite, check_heads, check_latent, check_norms_beside_colwise, check_whole_model
from .freeze import check_freeze
from .head_params import check_head_params
from .kv_heads import check_kv_colwise
from .lora import check_lora
from .packed import check_packed
from .tied import tied_groups
from .mesh import ParallelDims
from .pipeline import PipelineSplit, split_stages

__all__ = ["Resolution", "resolve", "match_modules", "AC_BLOCKS", "SHARD_DIMS", "shard_dims"]

AC_BLOCKS = "activation checkpointing blocks"  # what checkpointing's patterns are called
# (style, module type) -> {parameter: the dimension the style splits}
SHARD_DIMS: dict[tuple[str, type], dict[str, int]] = {
    ("colwise", nn.Linear): {"weight": 0, "bias": 0},
    ("rowwise", nn.Linear): {"weight": 1},
    ("colwise", nn.Embedding): {"weight": 1},
    ("rowwise", nn.Embedding): {"weight": 0},
    ("packed_colwise", nn.Linear): {"weight": 0, "bias": 0},  # parallel.packed
    ("experts_colwise_rowwise", nn.Module): {"gate_up_proj": 1, "down_proj": 2},
}
TORCH_CLASS = {"colwise": "ColwiseParallel", "rowwise": "RowwiseParallel"}
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


def shard_dims(style: str, module: nn.Module) -> dict[str, int] | None:
    """Which dimension of which parameter ``style`` splits over tp on ``module``; None if
    the style does not shard this kind of module."""
    return next((dims for (s, kind), dims in SHARD_DIMS.items()
                 if s == style and isinstance(module, kind)), None)


def _check_sharding(rule: Rule, path: str, module: nn.Module, tp: int, errs: ErrorList) -> None:
    style = rule.style.name
    dims = shard_dims(style, module)
    if dims is None:
        errs.add(f"style '{style}' cannot shard module '{path}' ({type(module).__name__}): "
                 f"PyTorch's {TORCH_CLASS[style]} shards nn.Linear and nn.Embedding only", rule.loc)
        return
    for pname, dim in dims.items():
        param = getattr(module, pname, None)
        if param is None:
            continue
        size = param.shape[dim]
        if rule.style.options.get("uneven") and size >= tp:
            continue  # ceil(size/tp) rows on the first ranks, fewer on the last
        if size % tp:
            errs.add(f"module '{path}' ({type(module).__name__}), parameter '{pname}': dimension {dim} "
                     f"of size {size} is not divisible by tp={tp} (rule '{rule.pattern}' is "
                     f"{style}){_uneven_hint(size, tp)}", rule.loc)


def _uneven_hint(size: int, tp: int) -> str:
    if size < tp:
        return f": fewer rows than ranks; use a tp of at most {size}"
    big = -(-size // tp)
    rows = [min(big, max(0, size - i * big)) for i in range(tp)]  # torch.chunk's split
    shown = ", ".join(map(str, rows)) if tp <= 8 else f"{rows[0]} ... {rows[-1]}"
    return (f"; add 'uneven: true' to the rule to split it unevenly ({shown} per rank; the "
            f"parameter keeps its {size} rows in checkpoints and exports)")


def _resolve_rules(plan: PlanSpec, res: Resolution, paths: list[str], modules: dict, params: set[str],
                   tp: int) -> None:
    errs = res.errors
    for rule in plan.rules:
        hits = _match(rule.pattern, paths)
        res.rules.append((rule, hits))
        if not hits and not res.stage:
            errs.add(_no_match(rule.pattern, "pattern", paths, params), rule.loc)
        for path in hits:
            other = res.rule_of.get(path)
            if other is not None:
                errs.add(f"module '{path}' is matched by two rules: '{other.pattern}' (line {other.loc.line}) and "
                         f"'{rule.pattern}' (line {rule.loc.line}){expert_tp_inside_ep(other, rule)}", rule.loc)
                continue
            res.rule_of[path] = rule
            module, parent = modules[path], modules.get(path.rpartition(".")[0])
            if rule.style.name in SHARDING_STYLES:
                _check_sharding(rule, path, module, tp, errs)
                check_composite(rule, path, module, errs)
                check_heads(rule, path, module, parent, tp, errs)
            elif rule.style.name in PACKED_STYLES:
                check_packed(rule, path, module, parent, tp, errs)
            elif rule.style.name == "mla_kv_a_proj":
                check_latent(rule, path, module, parent, errs)
            elif rule.style.name == "kv_colwise":
                check_kv_colwise(rule, path, module, parent, tp, errs)
    check_norms_beside_colwise(res, modules)
    check_experts(plan.mesh, res, modules)
    check_head_params(res, modules, tp)
    for path, rule in res.rule_of.items():
        if rule.style.name not in WHOLE_MODULE_STYLES:
            continue
        for inner, other in res.rule_of.items():
            if inner.startswith(path + ".") and other.style.name in SHARDING_STYLES:
                errs.add(f"rule '{rule.pattern}' ({rule.style.name}) replicates every parameter "
                         f"under '{path}', but rule '{other.pattern}' (line {other.loc.line}) "
                         f"shards '{inner}' inside it", rule.loc)
                break


def _resolve_attrs(plan: PlanSpec, res: Resolution, paths: list[str], modules: dict, params: set[str],
                   tp: int) -> None:
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


def _resolve_units(plan: PlanSpec, res: Resolution, modules: dict, params: set[str]) -> None:
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


def resolve(plan: PlanSpec, model: nn.Module, world_size: int, stage: bool = False) -> Resolution:
    """Resolve ``plan`` against ``model`` at ``world_size``; errors are collected, not raised.

    ``stage``: ``model`` is one pipeline stage of the model the plan was checked against,
    so a pattern matching nothing here (the embedding's rule on a middle stage) is fine.

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
    modules = dict(model.named_modules())
    paths, params = list(modules), {n for n, _ in model.named_parameters()}
    tp = dims.tp if dims else plan.mesh.tp
    _resolve_rules(plan, res, paths, modules, params, tp)
    _resolve_attrs(plan, res, paths, modules, params, tp)
    if plan.fsdp is not None:
        _resolve_units(plan, res, modules, params)
    elif dims is not None and dims.dp > 1:
        errs.add(f"the mesh has {dims.dp} data-parallel ranks but the plan has no 'fsdp' section, "
                 "so gradients would never be averaged; add 'fsdp: {units: [...]}' (or 'fsdp: {}' "
                 "to shard at the root only)", plan.mesh.loc)
    for blocks, target, what in ((plan.activation_checkpointing, res.ac_blocks, AC_BLOCKS),
                                 (plan.compile, res.compile_blocks, "compile blocks")):
        target += match_modules(blocks.blocks, what, "blocks pattern", blocks.loc, modules,
                                params, stage, errs) if blocks.enabled else []
    check_lora(plan.lora, modules, res.rule_of, stage, errs)
    if not stage:  # whole-model checks: a stage holds part of what they look at
        check_context_parallel(plan, model, tp, errs)
        check_whole_model(plan, res, model, modules)
        check_freeze(plan.freeze, model, errs)
    if plan.pipeline is not None and not stage:
        res.pipeline = split_stages(model, plan, dims.pp if dims else plan.mesh.pp)
        errs.extend(res.pipeline.errors)
        _check_tied_across_stages(res.pipeline, model, plan.pipeline.loc, errs)
    res.errors = _collapse_repeats(errs)
    return res


def _check_tied_across_stages(split: PipelineSplit, model: nn.Module, loc, errs: ErrorList) -> None:
    """A weight shared by modules on different stages would become two weights, one per
    stage, trained apart: refused (sharing it needs its gradient summed between stages)."""
    if split.errors:
        return
    for group in tied_groups(model):
        stages = {p: split.stage_of(p) for p, _ in group}
        if len({s.index for s in stages.values() if s is not None}) > 1:
            where = ", ".join(f"'{p}' on stage {s.index}" for p, s in stages.items() if s)
            errs.add(f"{' and '.join(repr(p + '.' + a) for p, a in group)} are one tied weight "
                     f"split over pipeline stages ({where}): tied weights across stages are "
                     "not supported; untie them in the model or do not use pipeline stages",
                     loc)


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
