"""One way to parallelize a model, shared by the trainer, the dry run and verify.

The order is torchtitan's: tensor parallel -> activation checkpointing -> compile -> FSDP2.
TP first, because FSDP2 shards the DTensors TP made along the data-parallel dimension;
checkpointing and compile wrap the TP'd block, and FSDP goes last so its hooks surround
everything (and so compile sees no FSDP code in the block).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import checkpoint

from ..plan.specs import FSDPSpec, PlanSpec, torch_dtype
from ..plan.styles import EP_STYLES, PACKED_STYLES, SEQUENCE_LOCAL
from .tp.attention import register_cpu_attention
from .context.sequence import apply_context_parallel
from .float8 import apply_float8, float8_style, gathers_float8
from .freeze import apply_freeze
from .tp.kv_heads import kv_style, localize_kv_groups
from .lora.adapters import apply_lora, freeze_base
from .fsdp_units import fsdp_calls
from .experts.style import ExpertParallel
from .mesh import cp_mesh, dp_mesh, expert_meshes
from .op_sac import op_checkpointed_forward
from .tp.packed import packed_style
from .report import ApplyReport
from .resolve import Resolution, resolve
from .experts.sequence_local import SequenceLocal
from .tp.tied import retie, tied_groups
from .tp.prepare_io import check_layout_counts
from .tp.styles import build_style

__all__ = ["apply_plan", "apply_tp", "apply_ep", "apply_ac", "apply_compile", "apply_fsdp",
           "loss_context"]

log = logging.getLogger("tpplan")


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, res: Resolution) -> DeviceMesh | None:
    """One ``parallelize_module`` call per matched module, then ``divide_by_tp``. Returns
    ``tp_mesh`` when the model's routers see its sequence shards (``sequence_local`` blocks:
    the load-balancing loss must gather their logits, :attr:`ApplyReport.router_shards`),
    else None."""
    from torch.distributed.tensor.parallel import parallelize_module

    register_cpu_attention()  # attention run on DTensors works on a CPU mesh too
    modules = dict(model.named_modules())
    styles = {id(rule): build_style(rule.style) for rule, _ in res.rules
              if rule.style.name not in (*PACKED_STYLES, *EP_STYLES, SEQUENCE_LOCAL)}
    tied = tied_groups(model)
    for path, rule in res.rule_of.items():
        if rule.style.name in EP_STYLES:
            continue  # apply_ep's, on the ep ranks; the experts stay whole on every tp rank
        if rule.style.name == SEQUENCE_LOCAL:  # its parameters but the routed experts'
            style = SequenceLocal(sequence_dim=rule.style.options.get("sequence_dim", 1),
                                  skip=tuple(p[len(path) + 1:] for p in expert_paths(res)
                                             if p.startswith(path + ".")))
        else:
            style = styles.get(id(rule)) or packed_style(  # packed: sizes from each module
                rule.style, modules[path], modules.get(path.rpartition(".")[0]))
        style = float8_style(style, modules[path])  # torchao's where the linear is float8
        parallelize_module(modules[path], tp_mesh, kv_style(style, rule, path, modules))
        if rule.style.name.startswith("prepare_"):
            check_layout_counts(modules[path], path, rule)
    retie(model, tied)  # each style made its own copy of a shared weight: share it again
    tp = tp_mesh.size()
    localize_kv_groups(modules, res.rule_of, tp)
    for attr_rule, found in res.attrs:
        for path, value in found:
            setattr(modules[path], attr_rule.attribute, value // tp)
    return tp_mesh if any(r.style.name == SEQUENCE_LOCAL for r in res.rule_of.values()) else None


def expert_paths(res: Resolution) -> list[str]:
    """The modules an ``expert_parallel`` rule matched."""
    return [p for p, rule in res.rule_of.items() if rule.style.name in EP_STYLES]


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh, res: Resolution) -> None:
    """Each experts module's experts spread over ``ep_mesh``, tokens routed by all-to-all
    (from each tp rank's sequence shard when ep borrows tp's ranks)."""
    from torch.distributed.tensor.parallel import parallelize_module

    modules = dict(model.named_modules())
    for path in expert_paths(res):
        parallelize_module(modules[path], ep_mesh, ExpertParallel(tokens_tp=res.dims.ep_tp))


def _checkpointed_forward(forward, *args, **kwargs):
    # Non-reentrant checkpointing composes with DTensor and FSDP2 hooks.
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_ac(model: nn.Module, blocks: list[str], every: int, per_op: bool = False) -> None:
    """Recompute every ``every``-th block in backward (``every=1`` is full checkpointing);
    ``per_op``: keep the outputs of the operators :mod:`tpplan.parallel.op_sac` names and
    recompute only the rest.

    The block's ``forward`` is wrapped on the instance, so module paths (and with them FSDP
    unit patterns and checkpoint keys) stay exactly as the plan names them.
    """
    wrapper = op_checkpointed_forward if per_op else _checkpointed_forward
    modules = dict(model.named_modules())
    for i, path in enumerate(blocks):
        if i % every == 0:
            block = modules[path]
            block.forward = functools.partial(wrapper, block.forward)


def apply_compile(model: nn.Module, blocks: list[str], fullgraph: bool) -> None:
    """``torch.compile`` each block in place: repeated blocks reuse one compiled graph."""
    modules = dict(model.named_modules())
    for path in blocks:
        modules[path].compile(fullgraph=fullgraph)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, spec: FSDPSpec, res: Resolution,
               experts: DeviceMesh | None = None) -> None:
    """``fully_shard`` each unit (deepest first, so nested units shard inside out), root last.

    A pattern entry is one call per matched module, a list entry one call for all of them.
    ``experts``: the efsdp mesh under expert parallelism: each experts module is a unit of
    its own, its local experts sharded over the efsdp ranks (tpplan.parallel.mesh)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs = {"mesh": mesh, "reshard_after_forward": spec.reshard_after_forward}
    if spec.param_dtype or spec.reduce_dtype:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=spec.param_dtype and torch_dtype(spec.param_dtype),
            reduce_dtype=spec.reduce_dtype and torch_dtype(spec.reduce_dtype))
    if spec.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    modules = dict(model.named_modules())
    if experts is not None:
        for path in expert_paths(res):
            fully_shard(modules[path], **{**kwargs, "mesh": experts})
    for paths in fsdp_calls(res):
        targets = [modules[p] for p in paths]
        # fully_shard takes a list for several modules that share one all-gather.
        fully_shard(targets if len(targets) > 1 else targets[0], **kwargs)
    fully_shard(model, **kwargs)


def apply_plan(plan: PlanSpec, model: nn.Module, mesh: DeviceMesh,
               stage: bool = False) -> ApplyReport:
    """Check, then TP -> AC -> compile -> FSDP2; returns the report of what was applied.

    ``stage``: ``model`` is one pipeline stage (:func:`tpplan.parallel.pipeline.stages.apply_pipeline`),
    parallelized on this rank's slice of the mesh (``mesh["tp"]``, ``mesh["dp_shard"]`` are
    within the stage's pp rank). :class:`~tpplan.plan.errors.PlanErrors` before touching the
    model if the plan does not fit."""
    start = time.perf_counter()
    res = resolve(plan, model, mesh.size(), stage=stage)
    res.errors.raise_if_any()
    dims = res.dims
    router_shards = None
    if plan.float8 is not None and mesh.device_type == "cuda":  # before TP (torchtitan's order)
        log.info("float8 (%s): %d linears", plan.float8.scaling,
                 apply_float8(model, plan, gathers_float8(plan, dims)))
    if dims.tp > 1:
        router_shards = apply_tp(model, mesh["tp"], res)
        log.info("applied tensor parallel: %d modules on tp=%d", len(res.rule_of), dims.tp)
    experts = None
    if dims.ep > 1:
        ep_mesh, efsdp_mesh = expert_meshes(mesh, dims.ep, dims.ep_borrows_tp)
        apply_ep(model, ep_mesh, res)
        experts = efsdp_mesh
        log.info("applied expert parallel: %d modules on ep=%d", len(expert_paths(res)), dims.ep)
    if plan.lora is not None:  # after TP (a style would take the adapters as its own), before FSDP
        n = apply_lora(plan.lora, model, mesh["tp"] if dims.tp > 1 else None, res.rule_of,
                       plan.train.seed)
        log.info("added LoRA adapters of rank %d to %d linear layers", plan.lora.rank, n)
    if cp_mesh(mesh) is not None:  # attention wrapped inside the TP'd block, before AC
        apply_context_parallel(model, cp_mesh(mesh), plan.context_parallel)
        log.info("applied context parallel: %s on cp=%d", plan.context_parallel.method, dims.cp)
    ac = plan.activation_checkpointing
    if ac.enabled:
        apply_ac(model, res.ac_blocks, ac.every, per_op=ac.mode == "op")
        log.info("applied %s activation checkpointing to %d blocks", ac.mode, len(res.ac_blocks))
    # left out of the plan: compiled on CUDA, but not pipeline stages or cp's attention (unchecked)
    if plan.compile.on(mesh.device_type, plan.pipeline is not None or cp_mesh(mesh) is not None) \
            and res.compile_blocks:
        apply_compile(model, res.compile_blocks, plan.compile.fullgraph)
        log.info("compiled %d blocks", len(res.compile_blocks))
    if plan.fsdp is not None:
        apply_fsdp(model, dp_mesh(mesh), plan.fsdp, res, experts)
        log.info("applied FSDP2: %d units + root on dp=%d", len(res.units), dims.dp)
    # Last: SequenceParallel turns requires_grad on for the norms it shards. LoRA freezes the
    # base first, so `freeze` can only freeze more.
    if plan.lora is not None:
        log.info("LoRA: %d parameters train, the base is frozen", freeze_base(plan.lora, model))
    if plan.freeze:
        log.info("froze %d parameters", apply_freeze(plan.freeze, model))
    return ApplyReport(res, seconds=time.perf_counter() - start, model=model, router_shards=router_shards)


def loss_context(plan: PlanSpec) -> contextlib.AbstractContextManager:
    """``loss_parallel()`` when the plan shards the logits over tp, else a no-op."""
    if plan.loss_parallel and plan.mesh.tp > 1:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return contextlib.nullcontext()
