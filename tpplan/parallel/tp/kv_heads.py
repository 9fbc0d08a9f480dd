"""Key/value projections with fewer heads than tp: each rank computes the KV heads its query
heads use (``kv_colwise``), vLLM's and Megatron's answer to tp > KV heads.

With ``H`` query heads sharded colwise over ``tp`` ranks, rank ``r`` holds query heads
``r*H/tp ... (r+1)*H/tp - 1``; grouped-query attention maps query head ``h`` to KV head
``h // (H/K)``, so every query head of rank ``r`` reads KV head ``r*K // tp`` (``K`` KV heads,
``tp`` a multiple of ``K``): ``tp/K`` consecutive ranks share one KV head.

The weight stays whole, a DTensor replicated on tp: its shape and checkpoint keys are the
full model's (a checkpoint resumes on any tp), and FSDP2 shards it over dp like a norm's.
Each rank computes the projection for all ``K`` heads (``K * head_dim`` outputs: small, the
reason there are few KV heads) and keeps its own head's columns. Backward hands the local
gradient back as a partial sum: the ranks sharing a KV head each hold their query heads'
contribution, and one all-reduce over tp sums them (FSDP2 does it while reducing, or the
DTensor of the gradient does when it is read); rows of the heads a rank does not hold are
zero there, so the sum is exactly the one-device gradient.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from .latent import LatentKVParallel, rope_dim_of

__all__ = ["KVColwiseParallel", "check_kv_colwise", "head_dim_of", "head_slice", "kv_style",
           "local_kv_groups", "localize_kv_groups"]


def head_slice(heads: int, tp: int, rank: int) -> tuple[int, int]:
    """(first head, head count) rank ``rank`` of ``tp`` holds of ``heads`` KV heads: its
    share where tp divides them, else the one head its query heads read."""
    if heads >= tp:
        return rank * heads // tp, heads // tp
    return rank * heads // tp, 1


def local_kv_groups(groups: int, kv_heads: int, tp: int) -> int:
    """Query heads per KV head on a rank (HF's ``num_key_value_groups``): ``H/K`` where tp
    divides ``K``, ``H/tp`` (one KV head per rank) where tp is a multiple of ``K``."""
    return groups if kv_heads >= tp else groups * kv_heads // tp


class KVColwiseParallel(ParallelStyle):
    """Colwise for a key or value projection whose heads tp may outnumber.

    Keyword Args:
        head_dim (int): width of one head (the projection's ``out_features`` is heads × this);
            tpplan fills it from the attention's ``head_dim`` attribute when a plan leaves it out.
        input_layouts (Placement, optional): the input's placement on tp when it is a plain
            tensor, as for ``ColwiseParallel``; default ``Replicate()``.

    The weight (and bias) become DTensors replicated on tp; the output is this rank's KV
    heads as a plain tensor, the layout attention code expects after a colwise projection.

    Example::

        >>> parallelize_module(attn.k_proj, tp_mesh, KVColwiseParallel(head_dim=64))
    """

    def __init__(self, *, head_dim: int | None = None, input_layouts: Any = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.input_layout = input_layouts or Replicate()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.head_dim is None:
            raise ValueError("KVColwiseParallel needs head_dim")
        heads = module.out_features // self.head_dim
        first, count = head_slice(heads, device_mesh.size(), device_mesh.get_local_rank())
        cols = slice(first * self.head_dim, (first + count) * self.head_dim)

        def replicate(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, param in list(mod.named_parameters(recurse=False)):
                dt = distribute_tensor(param, mesh, [Replicate()], src_data_rank=self.src_data_rank)
                mod.register_parameter(pname, nn.Parameter(dt, requires_grad=param.requires_grad))

        def prepare_input(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            x = inputs[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, [self.input_layout], run_check=False)
            if x.placements != (Replicate(),):
                x = x.redistribute(placements=[Replicate()])  # sequence shard: all-gather
            return (x, *inputs[1:])

        def own_heads(mod: nn.Module, out: DTensor, mesh: DeviceMesh):
            # Partial: each rank's gradient holds its query heads' share only (zero outside
            # its columns); the sum over tp is the whole gradient.
            return out.to_local(grad_placements=[Partial()])[..., cols]

        return distribute_module(module, device_mesh, replicate, prepare_input, own_heads)

    def __repr__(self) -> str:
        return f"KVColwiseParallel(head_dim={self.head_dim})"


GROUPS_ATTR = "num_key_value_groups"  # transformers' attention: query heads per KV head


def head_dim_of(rule: Any, parent: nn.Module | None) -> int | None:
    """The rule's ``head_dim``, else the attention's own (so verify's shrunk model, whose
    heads are narrower, needs no other plan)."""
    value = rule.style.options.get("head_dim", getattr(parent, "head_dim", None))
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def kv_style(style: ParallelStyle, rule: Any, path: str, modules: dict[str, nn.Module]
             ) -> ParallelStyle:
    """The style for one module: a ``kv_colwise`` without head_dim gets its attention's."""
    if isinstance(style, KVColwiseParallel) and style.head_dim is None:
        return KVColwiseParallel(head_dim=head_dim_of(rule, modules[path.rpartition(".")[0]]),
                                 input_layouts=style.input_layout)
    if isinstance(style, LatentKVParallel) and style.rope_dim is None:
        return LatentKVParallel(rope_dim=rope_dim_of(modules.get(path.rpartition(".")[0])))
    return style


def check_kv_colwise(rule: Any, path: str, module: nn.Module, parent: nn.Module | None, tp: int,
                     errs: Any) -> None:
    """A ``kv_colwise`` rule fits a linear projection of whole heads whose count tp divides
    or is a multiple of; the attention's query heads per KV head must stay whole per rank."""
    head_dim = head_dim_of(rule, parent)
    if head_dim is None:
        errs.add(f"rule '{rule.pattern}' (kv_colwise) needs head_dim: '{path}''s parent has no "
                 "integer 'head_dim' attribute; write {style: kv_colwise, head_dim: N}", rule.loc)
        return
    if not isinstance(module, nn.Linear):
        errs.add(f"style 'kv_colwise' cannot shard module '{path}' ({type(module).__name__}): "
                 "it takes a key or value projection (nn.Linear)", rule.loc)
        return
    if head_dim <= 0 or module.out_features % head_dim:
        errs.add(f"module '{path}' has {module.out_features} outputs, not a whole number of "
                 f"heads of head_dim {head_dim} (rule '{rule.pattern}' is kv_colwise)", rule.loc)
        return
    heads = module.out_features // head_dim
    if heads % tp and tp % heads:
        errs.add(f"module '{path}' projects {heads} KV heads and tp={tp} neither divides {heads} "
                 f"nor is a multiple of it: no rank layout gives whole KV heads; use a tp that "
                 f"divides {heads} or a multiple of {heads}", rule.loc)
        return
    groups = getattr(parent, GROUPS_ATTR, None)
    if isinstance(groups, int) and heads < tp and groups * heads % tp:
        errs.add(f"'{path.rpartition('.')[0]}' has {groups * heads} query heads, which tp={tp} "
                 "does not divide: each rank needs whole query heads", rule.loc)


def localize_kv_groups(modules: dict[str, nn.Module], rule_of: dict[str, Any], tp: int) -> None:
    """The attention beside each ``kv_colwise`` projection gets its local query heads per KV
    head (``num_key_value_groups``): with one KV head per rank it is ``H/tp``, not ``H/K``."""
    done = set()
    for path, rule in rule_of.items():
        parent = path.rpartition(".")[0]
        if rule.style.name != "kv_colwise" or parent in done:
            continue
        done.add(parent)
        attn = modules.get(parent)
        groups = getattr(attn, GROUPS_ATTR, None)
        if isinstance(groups, int):
            heads = modules[path].out_features // head_dim_of(rule, attn)
            setattr(attn, GROUPS_ATTR, local_kv_groups(groups, heads, tp))
