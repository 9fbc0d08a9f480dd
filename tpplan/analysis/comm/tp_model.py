"""The meta model a TP trace runs (:mod:`tpplan.analysis.comm.tp_trace`) and the names of its
collectives' groups.

The model gets what ``plan.apply`` gives it but FSDP: TP, expert parallelism, LoRA, context
parallelism, activation checkpointing and freezing, each on the (possibly cut) model, cast to
the compute dtype FSDP's mixed precision would use.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from ...parallel.apply import apply_ac, apply_ep, apply_tp
from ...parallel.context.sequence import apply_context_parallel
from ...parallel.freeze import apply_freeze
from ...parallel.lora.adapters import apply_lora, freeze_base
from ...parallel.mesh import MESH_DIMS, cp_mesh, expert_meshes, group_dim
from ...parallel.resolve import Resolution
from ...plan.specs import PlanSpec

__all__ = ["TraceMeshes", "prepare_traced", "trace_meshes"]


class _Dims(dict):
    """Process group name -> the mesh dimension it is, for this trace's mesh. A group of
    another mesh (DTensor's caches, kept across candidates, hand on an equal mesh and its
    group) is the dimension it was made for (DeviceMesh's ``mesh_<dimension>``) where
    this trace knows it; any other keeps its name, which no row reads as a dimension."""

    def __missing__(self, name: str) -> str:
        dim = group_dim(name)
        self[name] = dim if dim in self.values() else name
        return self[name]


@dataclasses.dataclass
class TraceMeshes:
    """The meshes a trace applies the plan over, and its groups' dimensions by group name."""
    mesh: object  # the dry run's DeviceMesh
    groups: dict[str, str]
    ep_mesh: object | None  # the experts' mesh where ep > 1 (its all-to-all, balanced routing)
    cp: object | None  # context parallelism's mesh, whose collectives are traced beside TP's


def trace_meshes(mesh, res: Resolution) -> TraceMeshes:
    """The dimension of each process group of ``mesh``, with ep's and cp's where the plan
    has them."""
    groups = _Dims({mesh[d].get_group().group_name: d for d in MESH_DIMS})
    ep_mesh = None
    if res.dims is not None and res.dims.ep > 1:  # the experts' all-to-all (balanced routing)
        ep_mesh, _ = expert_meshes(mesh, res.dims.ep, res.dims.ep_borrows_tp)
        groups[ep_mesh.get_group().group_name] = "ep"
    cp = cp_mesh(mesh)
    if cp is not None:  # context parallelism's collectives are traced beside TP's
        groups[cp.get_group().group_name] = "cp"
    return TraceMeshes(mesh, groups, ep_mesh, cp)


def prepare_traced(model: nn.Module, plan: PlanSpec, res: Resolution, meshes: TraceMeshes,
                   dtype: torch.dtype) -> nn.Module:
    """``model`` cast to ``dtype`` with the plan applied but FSDP, for the rules of the
    modules still in it (the container may have been cut to a few blocks)."""
    mesh, ep_mesh, cp = meshes.mesh, meshes.ep_mesh, meshes.cp
    if dtype != torch.float32:
        model.to(dtype)
    # Only the modules still in the model: the container may have been cut to 3 blocks.
    paths = {p for p, _ in model.named_modules()}
    rule_of = {p: r for p, r in res.rule_of.items() if p in paths}
    if res.dims.tp > 1:  # as apply does: at tp 1 (an ep-only run) the rules do nothing
        apply_tp(model, mesh["tp"], dataclasses.replace(
            res, rule_of=rule_of,
            attrs=[(a, [(p, v) for p, v in found if p in paths]) for a, found in res.attrs]))
    if ep_mesh is not None:
        apply_ep(model, ep_mesh, dataclasses.replace(res, rule_of=rule_of))
    if plan.lora is not None:  # the adapters' gradients are reduced over tp too
        apply_lora(plan.lora, model, mesh["tp"], rule_of, plan.train.seed)
    ac = plan.activation_checkpointing
    if cp is not None:
        apply_context_parallel(model, cp, plan.context_parallel)
    if ac.enabled:
        # Recomputed blocks re-issue their forward collectives in backward: count them.
        apply_ac(model, [p for p in res.ac_blocks if p in paths], ac.every)
    # What apply freezes has no gradient: no reduction after backward, and no input
    # gradient wanted where nothing before it trains (a frozen embedding's, say).
    if plan.lora is not None:
        freeze_base(plan.lora, model)
    if plan.freeze:
        apply_freeze(plan.freeze, model)
    return model
