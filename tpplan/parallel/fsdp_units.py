"""FSDP2 units as the plan resolves them: which ``fully_shard`` calls, and how large each is.

:func:`fsdp_calls` is the list :func:`tpplan.parallel.apply.apply_fsdp` walks, so the sizes
here describe exactly the groups that apply builds. :func:`unit_sizes` computes each
group's all-gather from shapes alone, the way FSDP2 lays it out: every parameter's
tensor-parallel shard (the plan's style fixes which dimension tp splits: ``resolve.shard_dims``) is split again
along dimension 0 over the ``dp_shard`` ranks, dimension 0 padded up to a multiple of them
(``torch.chunk`` sizes; rank 0 holds the padded chunk), and the all-gather returns
``padded shard × dp_shard`` elements. Nothing is read from FSDP2's internals, so the same
numbers come out of a meta model, a real one, or a model not yet parallelized.

Only parameters that train get a gradient, so a group's reduce-scatter covers those alone
(none at all for a group that is wholly frozen): under ``lora`` the adapters and
``modules_to_save``, less what ``freeze`` freezes. Given the plan, the adapters are counted
whether the model has them yet or not (placed over tp as their base's style places them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from ..plan.patterns import generalize
from ..plan.specs import PlanSpec
from .mesh import ParallelDims
from ..plan.styles import EP_STYLES
from .experts.forms import expert_count
from .freeze import frozen_names
from .lora.sizes import adapter_shapes, adapter_tp_dim, trained_names
from .resolve import Resolution, shard_dims

__all__ = ["UnitShapes", "UnitSize", "fsdp_calls", "unit_shapes", "unit_sizes", "tp_local_shape"]

ROOT = "<root>"


@dataclass(frozen=True)
class UnitSize:
    """One ``fully_shard`` parameter group: its label, its all-gather's output elements and
    its reduce-scatter's input elements (``trained``: its parameters that get a gradient;
    None: all of them)."""

    unit: str
    elements: int
    mesh_dim: str = "dp_shard"  # "efsdp": an experts module under expert parallelism
    trained: int | None = None
    order: int = 0  # where its first module comes in the model (forward order, roughly)

    @property
    def reduced(self) -> int:
        """Elements of the group's gradient reduce-scatter (0: the group has none)."""
        return self.elements if self.trained is None else self.trained


def fsdp_calls(res: Resolution) -> list[list[str]]:
    """Module paths of each ``fully_shard`` call, in the order apply makes them: deepest
    first, so nested units shard inside out (the root, ``fully_shard(model)``, comes after).
    A pattern entry is one call per matched module, a list entry one call for all of them."""
    calls: list[list[str]] = []
    for unit, paths in res.units:
        calls += [paths] if unit.grouped else [[p] for p in paths]
    calls = [paths for paths in calls if paths]
    calls.sort(key=lambda paths: -min(p.count(".") for p in paths))
    return calls


def tp_local_shape(name: str, shape: tuple[int, ...], module: nn.Module, res: Resolution,
                   tp: int) -> tuple[int, ...]:
    """The shape of parameter ``name`` (``module.path.weight``) on one tp rank."""
    path, _, pname = name.rpartition(".")
    rule = res.rule_of.get(path)
    if tp == 1:
        return shape
    if rule is None:  # an adapter follows its base's style
        dim = adapter_tp_dim(name, res.rule_of)
    else:
        dim = (shard_dims(rule.style.name, module) or {}).get(pname)
    if dim is None:
        return shape
    out = list(shape)
    out[dim] //= tp  # resolve checked that it divides
    return tuple(out)


def _gathered(shape: tuple[int, ...], shards: int) -> int:
    """Elements of FSDP2's all-gather output for one parameter of ``shape``."""
    if not shape:
        return shards  # a 0-d parameter is one element per rank
    rest = 1
    for s in shape[1:]:
        rest *= s
    return -(-shape[0] // shards) * rest * shards


def plan_parameters(model: nn.Module, plan: PlanSpec | None) -> list[tuple[str, tuple, bool]]:
    """(name, global shape, trains) of every parameter ``plan`` gives ``model``: with a
    ``lora`` section its adapters too, added or not yet; without ``plan``, as ``model`` is."""
    params = [(n, tuple(p.shape), p.requires_grad) for n, p in model.named_parameters()]
    if plan is None:
        return params
    trains = {n for n, *_ in params}
    if plan.lora is not None:
        have = set(trains)
        params += [(n, s, True) for n, s in adapter_shapes(plan.lora, model).items()
                   if n not in have]
        trains = trained_names(plan.lora, model)
    trains -= frozen_names(plan.freeze, [n for n, *_ in params]) if plan.freeze else set()
    return [(n, s, n in trains) for n, s, _ in params]


@dataclass(frozen=True)
class UnitShapes:
    """What :func:`unit_sizes` reads of the model, the plan and the mesh but data
    parallelism: each group's label and place, and each parameter it gathers as ``(group,
    local shape, trains)``, its shape on one tp (or, for an expert's, ep) rank; the groups
    of experts first (over ``efsdp``), then the others, the root last."""

    experts: tuple[tuple[str, int], ...]  # (path, order) of each experts module's group
    groups: tuple[tuple[str, int], ...]  # (label, order) of each other group
    params: tuple[tuple[int, tuple[int, ...], bool], ...]  # group index over both

    def sized(self, dims: ParallelDims) -> list[UnitSize]:
        """The groups' :class:`UnitSize` at ``dims``' data parallelism (``dp_shard × cp``
        ranks, ``efsdp`` for the experts'); a group that gathers nothing is left out."""
        n_ep = len(self.experts)
        elements, trained = [0] * (n_ep + len(self.groups)), [0] * (n_ep + len(self.groups))
        shards = dims.dp_shard * dims.cp
        for i, local, trains in self.params:
            n = _gathered(local, dims.efsdp if i < n_ep else shards)
            elements[i] += n
            trained[i] += n * trains
        return [UnitSize(path, elements[i], "efsdp", trained[i], order)
                for i, (path, order) in enumerate(self.experts)] + \
            [UnitSize(label, elements[n_ep + i], trained=trained[n_ep + i], order=order)
             for i, (label, order) in enumerate(self.groups) if elements[n_ep + i]]


def unit_sizes(model: nn.Module, res: Resolution, dims: ParallelDims,
               plan: PlanSpec | None = None) -> list[UnitSize]:
    """Each FSDP2 parameter group of the plan, in apply order, the root last; a call whose
    parameters all belong to deeper calls makes no group and is left out, as in FSDP2.
    ``plan``: what trains and the adapters come from it (:func:`plan_parameters`)."""
    return unit_shapes(model, res, dims, plan).sized(dims)


def unit_shapes(model: nn.Module, res: Resolution, dims: ParallelDims,
                plan: PlanSpec | None = None) -> UnitShapes:
    """:func:`unit_sizes` less the data-parallel split: the same for every dp_shard (and
    cp) of one tp, ep and resolution (:meth:`UnitShapes.sized` at each)."""
    modules = dict(model.named_modules())
    owner: dict[str, int] = {}  # parameter name -> index of the call that shards it
    calls = fsdp_calls(res)
    for i, paths in enumerate(calls):
        for path in paths:
            for name, _ in modules[path].named_parameters(prefix=path):
                owner.setdefault(name, i)
    # Under expert parallelism each experts module is a unit of its own, sharded first
    # (apply_fsdp): its num_experts / ep local experts, over the efsdp ranks.
    experts = [p for p, r in res.rule_of.items() if r.style.name in EP_STYLES] \
        if dims.ep > 1 else []
    ep_owner = {f"{path}.{n}": i for i, path in enumerate(experts)
                for n, _ in modules[path].named_parameters(recurse=False)}
    whole, elsewhere = set(), set()  # a list of experts: each whole, rank 0 has the first E/ep
    for i, path in enumerate(experts):
        if isinstance(modules[path], nn.ModuleList):
            local = expert_count(modules[path]) // dims.ep
            for n, _ in modules[path].named_parameters(prefix=path):
                ep_owner[n] = i
                (whole if int(n[len(path) + 1:].split(".")[0]) < local else elsewhere).add(n)
    params = []
    for name, shape, trains in plan_parameters(model, plan):
        if name in elsewhere:
            continue
        if name in ep_owner:
            local = tuple(shape) if name in whole else (shape[0] // dims.ep, *shape[1:])
            params.append((ep_owner[name], local, trains))
            continue
        i = owner.get(name)
        if i is None:  # an adapter not added yet: its base's unit
            i = next((j for j, paths in enumerate(calls)
                      if any(name.startswith(p + ".") for p in paths)), len(calls))
        path = name.rpartition(".")[0]
        local = tp_local_shape(name, shape, modules.get(path), res, dims.tp)
        params.append((len(experts) + i, local, trains))
    labels = [paths[0] if len(paths) == 1 else f"{generalize(paths[0])} ({len(paths)} modules)"
              for paths in calls] + [ROOT]
    position = {p: i for i, p in enumerate(modules)}
    orders = [min(position[p] for p in paths) for paths in calls] + [len(position)]
    return UnitShapes(tuple((p, position[p]) for p in experts), tuple(zip(labels, orders)),
                      tuple(params))
