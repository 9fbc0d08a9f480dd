"""One way to parallelize a model, shared by the trainer, the dry run and verify.

The order is torchtitan's: tensor parallel -> activation checkpointing -> compile -> FSDP2.
TP first, because FSDP2 shards the DTensors TP made along the data-parallel dimension;
checkpointing and compile wrap the TP'd block, and FSDP goes last so its hooks surround
everything (and so compile sees no FSDP code in the block).
"""

from __future__ import annotations

import functools
import logging
import time

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import checkpoint

from .resolve import Resolution

__all__ = ["apply_plan", "apply_tp", "apply_ac", "apply_compile", "apply_fsdp", "dp_mesh",
           "dp_rank"]

log = logging.getLogger("tpplan")

DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, res: Resolution) -> None:
    """One ``parallelize_module`` call per matched module, then ``divide_by_tp``."""
    from torch.distributed.tensor.parallel import parallelize_module

    modules = dict(model.named_modules())
    styles = {id(rule): rule.style.build() for rule, _ in res.rules}
    for path, rule in res.rule_of.items():
        parallelize_module(modules[path], tp_mesh, styles[id(rule)])
    tp = tp_mesh.size()
    for attr_rule, found in res.attrs:
        for path, value in found:
            setattr(modules[path], attr_rule.attribute, value // tp)


def _checkpointed_forward(forward, *args, **kwargs):
    # Non-reentrant checkpointing composes with DTensor and FSDP2 hooks.
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_ac(model: nn.Module, blocks: list[str], every: int) -> None:
    """Recompute every ``every``-th block in backward (``every=1`` is full checkpointing).

    The block's ``forward`` is wrapped on the instance, so module paths (and with them FSDP
    unit patterns and checkpoint keys) stay exactly as the plan names them.
    """
    modules = dict(model.named_modules())
    for i, path in enumerate(blocks):
        if i % every == 0:
            block = modules[path]
            block.forward = functools.partial(_checkpointed_forward, block.forward)


def apply_compile(model: nn.Module, blocks: list[str], fullgraph: bool) -> None:
    """``torch.compile`` each block in place: repeated blocks reuse one compiled graph."""
    modules = dict(model.named_modules())
    for path in blocks:
        modules[path].compile(fullgraph=fullgraph)


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards over: 2-D ``(dp_replicate, dp_shard)`` is HSDP."""
    if mesh["dp_replicate"].size() > 1:
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp_shard"]


def dp_rank(mesh: DeviceMesh) -> int:
    """This rank's data-parallel index (which slice of the global batch it takes); tp peers
    share it, so they see the same batch."""
    return mesh["dp_replicate"].get_local_rank() * mesh["dp_shard"].size() + \
        mesh["dp_shard"].get_local_rank()


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, plan, res: Resolution) -> None:
    """``fully_shard`` each unit (deepest first, so nested units shard inside out), root last.

    A pattern entry is one call per matched module, a list entry one call for all of them."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    spec = plan.fsdp
    kwargs = {"mesh": mesh, "reshard_after_forward": spec.reshard_after_forward}
    if spec.param_dtype or spec.reduce_dtype:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=DTYPE.get(spec.param_dtype), reduce_dtype=DTYPE.get(spec.reduce_dtype))
    if spec.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    modules = dict(model.named_modules())
    units = []
    for unit, paths in res.units:
        units += [paths] if unit.grouped else [[p] for p in paths]
    units = [paths for paths in units if paths]
    units.sort(key=lambda paths: -min(p.count(".") for p in paths))
    for paths in units:
        targets = [modules[p] for p in paths]
        # fully_shard takes a list for several modules that share one all-gather.
        fully_shard(targets if len(targets) > 1 else targets[0], **kwargs)
    fully_shard(model, **kwargs)


def apply_plan(plan, model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Check, then TP -> AC -> compile -> FSDP2; leaves a report in ``plan.last_report``."""
    from .report import ApplyReport

    start = time.perf_counter()
    res = plan.check(model, mesh.size())
    dims = res.dims
    if dims.tp > 1:
        apply_tp(model, mesh["tp"], res)
        log.info("applied tensor parallel: %d modules on tp=%d", len(res.rule_of), dims.tp)
    ac = plan.activation_checkpointing
    if ac.mode != "none":
        apply_ac(model, res.ac_blocks, ac.every if ac.mode == "selective" else 1)
        log.info("applied %s activation checkpointing to %d blocks", ac.mode, len(res.ac_blocks))
    if plan.compile.mode != "none":
        apply_compile(model, res.compile_blocks, plan.compile.fullgraph)
        log.info("compiled %d blocks", len(res.compile_blocks))
    if plan.fsdp is not None:
        apply_fsdp(model, dp_mesh(mesh), plan, res)
        log.info("applied FSDP2: %d units + root on dp=%d", len(res.units), dims.dp)
    plan.last_report = ApplyReport(plan, res, seconds=time.perf_counter() - start, model=model)
    return model
