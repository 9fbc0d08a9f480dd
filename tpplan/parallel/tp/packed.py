"""tpplan's styles for packed weights: ``packed_colwise`` and ``experts_colwise_rowwise``.

A packed weight stacks parts along one dimension (``qkv_proj``: ``[q; k; v]``,
``gate_up_proj``: ``[gate; up]``). Split by plain rows, rank 0 would get the queries and
rank 1 the keys and values. These styles split every part over tp, so rank ``t`` computes
``[q_t, k_t, v_t]`` (or ``[gate_t, up_t]``), which the model's own ``chunk``/slicing then
takes apart on the local output.

Representation (see :mod:`tpplan.plan.packing`): the parameter is a DTensor ``Shard(dim)``
of the tp-interleaved tensor, so each rank's shard is one contiguous block (FSDP2 shards it
further like any other), and the module records its :class:`~tpplan.plan.packing.Packing`
in ``module.tpplan_packed``. DTensor's own ``full_tensor()`` of such a parameter is in the
interleaved order; checkpoints, HF weights, initialization and verify convert with
:func:`to_model_order` / :func:`to_interleaved` (they are keyed and shaped by the full model,
and resume on any tp). ``torch``'s ``_StridedShard`` describes equal parts only (not q, k
and v of grouped-query attention) and DCP writes it as if its rows were contiguous, so it
is not used.

Expert parallelism (experts spread over ranks, tokens moved with all-to-all) would be a
style on the same experts module, on an ``ep`` mesh dimension: ``experts_colwise_rowwise``
is the seam (it owns the experts' forward and the sum of their outputs).
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from ..._torch.modules import own_parameters, swapped
from ...plan.errors import ErrorList
from ...plan.packing import ATTR, Packing, part_sizes
from ...plan.specs import Rule
from ...plan.styles import Layout, StyleSpec

__all__ = ["PackedColwiseParallel", "ExpertsColwiseRowwise", "check_packed", "packed_style",
           "to_interleaved", "to_model_order"]

EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def to_interleaved(full: torch.Tensor, packing: Packing) -> torch.Tensor:
    """The model-order tensor in the tp-interleaved order tpplan holds it in."""
    index = torch.tensor(packing.order(), device=full.device)
    return full.index_select(packing.dim, index)


def to_model_order(held: torch.Tensor, packing: Packing) -> torch.Tensor:
    """The inverse of :func:`to_interleaved` (a gathered gradient, a full parameter)."""
    index = torch.tensor(packing.order(), device=held.device)
    return torch.empty_like(held).index_copy_(packing.dim, index, held)


def _distribute(module: nn.Module, name: str, mesh: DeviceMesh, dim: int,
                packing: Packing | None, src: int | None) -> None:
    param = own_parameters(module)[name]
    full = param.detach() if packing is None else to_interleaved(param.detach(), packing)
    dt = distribute_tensor(full, mesh, [Shard(dim)], src_data_rank=src)
    module.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))


class PackedColwiseParallel(ColwiseParallel):
    """Colwise over each packed part of a linear layer's output.

    Keyword Args:
        sizes (sequence of int): the parts' sizes along the output (``[q, k, v]`` rows).
        input_layouts (Placement, optional): the input's layout, default replicated.
        parent (nn.Module, optional): the module holding the layer (an attention);
            its ``per_rank`` attributes become per-rank (divided by tp), on the parent
            itself where it has them, else on a copy of its ``config``.
        per_rank (sequence of str): those attribute names.

    The output is always a local tensor ``[part0_t, part1_t, ...]``.

    Example::

        >>> parallelize_module(attn.qkv_proj, tp_mesh, PackedColwiseParallel(sizes=[64, 16, 16]))
    """

    def __init__(self, *, sizes, input_layouts=None, parent: nn.Module | None = None,
                 per_rank=()):
        super().__init__(input_layouts=input_layouts, use_local_output=True)
        self.sizes = tuple(sizes)
        self.parent = parent
        self.per_rank = tuple(per_rank)

    def _partition_linear_fn(self, name, module, device_mesh):
        packing = Packing(0, self.sizes, device_mesh.size())
        names = [n for n, p in own_parameters(module).items() if p is not None]
        for pname in names:
            _distribute(module, pname, device_mesh, 0, packing, self.src_data_rank)
        setattr(module, ATTR, {pname: packing for pname in names})

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.parent is not None and self.per_rank:
            _per_rank_view(self.parent, self.per_rank, device_mesh.size())
        return super()._apply(module, device_mesh)


def _per_rank_view(parent: nn.Module, names: tuple[str, ...], tp: int) -> None:
    """The attributes that size the parts, per rank: the parent's own, or a per-module copy
    of its ``config`` (Phi-3's attention slices q by ``config.num_attention_heads``)."""
    config = getattr(parent, "config", None)
    view = copy.copy(config) if config is not None else None
    for name in dict.fromkeys(names):
        if isinstance(getattr(parent, name, None), int):
            setattr(parent, name, getattr(parent, name) // tp)
        if view is not None and isinstance(getattr(view, name, None), int):
            setattr(view, name, getattr(view, name) // tp)
    if view is not None:
        parent.config = view


def _summed_grad(x: Any, mesh: DeviceMesh) -> Any:
    """Identity forward; backward sums the gradient over tp (each rank's is partial)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return x
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    return x.to_local(grad_placements=[Partial()])


def _experts_forward(module: nn.Module, forward, mesh: DeviceMesh, *args, **kwargs):
    args = tuple(_summed_grad(a, mesh) for a in args)
    kwargs = {k: _summed_grad(v, mesh) for k, v in kwargs.items()}
    held = own_parameters(module)
    local = {n: held[n].to_local() if isinstance(held[n], DTensor) else held[n] for n in EXPERT_PARAMS}
    with swapped(module, parameters=local):  # the experts' own code on this rank's slices
        out = forward(*args, **kwargs)  # (eager, batched_mm, grouped_mm)
    partial = DTensor.from_local(out, mesh, [Partial()], run_check=False)
    return partial.redistribute(placements=[Replicate()]).to_local()


class ExpertsColwiseRowwise(ParallelStyle):
    """Tensor parallelism inside every routed expert of a mixture-of-experts module.

    The module holds ``gate_up_proj`` [experts, 2 x inter, hidden] (gate and up halves) and
    ``down_proj`` [experts, hidden, inter]. Each rank keeps, for every expert, its slice of
    the intermediate dimension: of gate and of up (packed, dimension 1) and of down's input
    (``Shard(2)``); it runs the experts' forward on those slices, and the outputs, partial
    sums, are all-reduced over tp. The inputs' gradients (hidden states, routing weights)
    are summed over tp in backward. The router stays replicated. Identity (zero-compute)
    experts, ``nn.Identity`` children (LongCat-Flash), get their input divided by tp, so the
    sum counts them once (transformers' ``moe_identity_expert``).

    Example::

        >>> parallelize_module(block.mlp.experts, tp_mesh, ExpertsColwiseRowwise())
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        inter = module.gate_up_proj.shape[1] // 2
        packing = Packing(1, (inter, inter), device_mesh.size())
        _distribute(module, "gate_up_proj", device_mesh, 1, packing, self.src_data_rank)
        _distribute(module, "down_proj", device_mesh, 2, None, self.src_data_rank)
        setattr(module, ATTR, {"gate_up_proj": packing})
        module.forward = functools.partial(_experts_forward, module, module.forward, device_mesh)
        tp = device_mesh.size()
        for child in module.children():  # LongCat's zero-compute experts: every rank adds the
            if isinstance(child, nn.Identity):  # whole token, which the sum would count tp
                child.register_forward_pre_hook(lambda m, args: (args[0] / tp, *args[1:]))
        return module

    def __repr__(self) -> str:
        return "ExpertsColwiseRowwise()"


def _parts(spec: StyleSpec, module: nn.Module, parent: nn.Module | None
           ) -> tuple[list[int], list[str]] | str:
    """The parts' relative sizes and the attribute names among them, or why not."""
    parts = spec.options["parts"]
    if isinstance(parts, int):
        return [1] * parts, []
    values, names = [], []
    config = getattr(parent, "config", None)
    for p in parts:
        if isinstance(p, int):
            values.append(p)
            continue
        value = getattr(parent, p, None)
        value = value if isinstance(value, int) else getattr(config, p, None)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            return (f"part '{p}' names no positive integer attribute of the layer's parent "
                    f"({type(parent).__name__}) or of its config")
        values.append(value)
        names.append(p)
    return values, names


def packed_sizes(spec: StyleSpec, module: nn.Module, parent: nn.Module | None
                 ) -> tuple[list[int], list[str]] | str:
    """The parts' sizes along the output of ``module`` and the attributes that become per
    rank, or why the rule does not fit the layer."""
    got = _parts(spec, module, parent)
    if isinstance(got, str):
        return got
    values, names = got
    sizes = part_sizes(module.out_features, values)
    if sizes is None:
        return (f"its {module.out_features} outputs cannot be parts of relative sizes "
                f"{values} (they do not divide it)")
    return sizes, names


def check_packed(rule: Rule, path: str, module: nn.Module, parent: nn.Module | None, tp: int,
                 errs: ErrorList) -> None:
    """Whether ``rule`` (a packed style) fits ``module`` at ``tp``; errors at the rule."""
    where = f"module '{path}' ({type(module).__name__})"
    if rule.style.name == "experts_colwise_rowwise":
        params = dict(module.named_parameters(recurse=False))
        shapes = [params[n].shape if n in params else None for n in EXPERT_PARAMS]
        if any(s is None or len(s) != 3 for s in shapes):
            errs.add(f"{where} holds no 3-D 'gate_up_proj' and 'down_proj' (experts as "
                     "parameters): experts_colwise_rowwise cannot shard it", rule.loc)
        elif getattr(module, "is_transposed", False) or [n for n in params if "bias" in n]:
            errs.add(f"{where} stores its experts transposed or with biases, which "
                     "experts_colwise_rowwise does not shard yet; leave it replicated", rule.loc)
        elif shapes[0][1] % (2 * tp):
            errs.add(f"{where}: each expert's intermediate size {shapes[0][1] // 2} is not "
                     f"divisible by tp={tp}", rule.loc)
        return
    if not isinstance(module, nn.Linear):
        errs.add(f"style 'packed_colwise' shards nn.Linear only, not {where}", rule.loc)
        return
    got = packed_sizes(rule.style, module, parent)
    if isinstance(got, str):
        errs.add(f"{where}: {got}", rule.loc)
        return
    head_dim = getattr(parent, "head_dim", None)
    for i, size in enumerate(got[0]):
        unit, what = (head_dim, "heads") if isinstance(head_dim, int) and head_dim > 0 \
            and size % head_dim == 0 else (1, "rows")
        if (size // unit) % tp:
            errs.add(f"{where}: packed part {i} has {size // unit} {what} and tp={tp} does not "
                     f"divide {size // unit}", rule.loc)


def packed_style(spec: StyleSpec, module: nn.Module, parent: nn.Module | None) -> ParallelStyle:
    """The style object for one module a packed rule matches (sizes come from the module)."""
    if spec.name == "experts_colwise_rowwise":
        return ExpertsColwiseRowwise()
    sizes, names = packed_sizes(spec, module, parent)
    layout = spec.options.get("input_layouts")
    return PackedColwiseParallel(sizes=sizes, parent=parent, per_rank=names,
                                 input_layouts=layout.to_torch() if isinstance(layout, Layout)
                                 else None)
