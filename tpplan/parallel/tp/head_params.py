"""Parameters an attention module uses itself, one entry per head (``head_params``).

Attention sinks (GPT-OSS-style ``sinks[heads]``: Granite-SWA, HY-V4), Beam's
``gate_bias[heads]``: the module reads them beside its colwise projections, so on a rank
holding heads ``first ... first+count-1`` it must see exactly those entries. PyTorch has no
style for a bare parameter (it has no forward of its own); transformers shards it with its
own plan entry (``self_attn.sinks: colwise``) and runs the owner with local tensors
(``self_attn: local_params``). tpplan says both in one rule on the owner:
``{style: local_params, head_params: [sinks]}``, or ``head_params`` on the owner's
``prepare_*`` rule.

The layout follows the heads of the projections (:func:`tpplan.parallel.tp.kv_heads.head_slice`):

- ``n`` entries that tp divides: the parameter is a DTensor sharded on dimension 0, rank ``r``
  holding entries ``r*n/tp ...``, as colwise gives it those heads. Its gradient is exact
  with no communication: only this rank's heads read its entries.
- ``n`` entries that tp is a multiple of (per KV head with ``kv_colwise``): the parameter is
  whole, replicated on tp; each rank takes the entry of the KV head its query heads use, and
  the gradient comes back as a partial sum over the ranks sharing it (one all-reduce).

During the owner's forward the parameter is this rank's slice as a plain tensor (a forward
pre-hook swaps it in, a forward hook puts the DTensor back, also when the forward
raises: :func:`tpplan._torch.modules.swap_around_forward`), so the model's code needs no
change; FSDP2, checkpoints and exports see the full-shaped DTensor.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from ..._torch.modules import own_parameters, swap_around_forward
from ...plan.errors import nearest
from .kv_heads import head_slice

__all__ = ["HeadParamsParallel", "check_head_params", "head_params_of", "sharded_heads"]


class HeadParamsParallel(ParallelStyle):
    """Split a module's own per-head parameters like the heads of its colwise projections.

    Keyword Args:
        head_params (list[str]): names of parameters registered on the module itself whose
            dimension 0 runs over heads (query heads, or KV heads under ``kv_colwise``).
        inner (ParallelStyle, optional): a style applied to the same module first (the
            ``prepare_input`` that shares one input among its projections).

    Example::

        >>> parallelize_module(attn, tp_mesh, HeadParamsParallel(head_params=["sinks"]))
    """

    def __init__(self, *, head_params: list[str], inner: ParallelStyle | None = None) -> None:
        super().__init__()
        self.head_params = list(head_params)
        self.inner = inner

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.inner is not None:
            module = self.inner._apply(module, device_mesh)
        tp, rank = device_mesh.size(), device_mesh.get_local_rank()
        slices: dict[str, slice | None] = {}
        for name in self.head_params:
            param = own_parameters(module)[name]
            n = param.shape[0]
            if n % tp == 0:
                placement, slices[name] = Shard(0), None
            else:  # fewer entries than ranks: whole, each rank reads its KV head's entry
                first, count = head_slice(n, tp, rank)
                placement, slices[name] = Replicate(), slice(first, first + count)
            dt = distribute_tensor(param, device_mesh, [placement], src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))

        def local(mod: nn.Module) -> dict[str, Any]:
            own = own_parameters(mod)
            return {name: own[name].to_local() if part is None else
                    own[name].to_local(grad_placements=[Partial()])[part]
                    for name, part in slices.items() if isinstance(own[name], DTensor)}

        swap_around_forward(module, local)
        return module

    def __repr__(self) -> str:
        inner = f", inner={self.inner!r}" if self.inner is not None else ""
        return f"HeadParamsParallel(head_params={self.head_params}{inner})"


def head_params_of(rule: Any) -> list[str]:
    """The ``head_params`` a rule names (none for most rules)."""
    return list(rule.style.options.get("head_params") or []) if rule is not None else []


def sharded_heads(res: Any, modules: dict[str, nn.Module], parent: str) -> list[nn.Linear]:
    """The projections directly under ``parent`` whose output is split by heads over tp."""
    out = []
    for path, rule in res.rule_of.items():
        module = modules[path]
        if path.rpartition(".")[0] != parent or not isinstance(module, nn.Linear):
            continue
        gathered = getattr(rule.style.options.get("output_layouts"), "kind", None) == "replicate"
        if rule.style.name in ("colwise", "packed_colwise", "kv_colwise") and not gathered:
            out.append(module)
    return out


def check_head_params(res: Any, modules: dict[str, nn.Module], tp: int) -> None:
    """Each named parameter is the module's own, has per-head entries that fit tp, and sits
    beside projections sharded by heads (otherwise the module would see whole heads and a
    slice of the parameter)."""
    for path, rule in res.rule_of.items():
        names = head_params_of(rule)
        if not names:
            continue
        module = modules[path]
        own = dict(module.named_parameters(recurse=False))
        beside = sharded_heads(res, modules, path)
        if not beside:
            res.errors.add(f"rule '{rule.pattern}' splits head_params ({', '.join(names)}) of "
                           f"'{path}', but no projection directly under it is sharded by heads "
                           "(colwise, packed_colwise or kv_colwise): the module would see whole "
                           "heads and a slice of the parameter; shard its projections or drop "
                           "head_params", rule.loc)
            continue
        for name in names:
            param = own.get(name)
            if param is None:
                res.errors.add(f"rule '{rule.pattern}': module '{path}' "
                               f"({type(module).__name__}) has no parameter '{name}' of its "
                               f"own{nearest(name, list(own))}", rule.loc)
                continue
            n = param.shape[0] if param.dim() else 0
            if not n or (n % tp and tp % n):
                res.errors.add(f"rule '{rule.pattern}': '{path}.{name}' has {n} entries on "
                               f"dimension 0 and tp={tp} neither divides {n} nor is a multiple of "
                               "it: no rank layout gives each rank its heads' entries", rule.loc)
            elif not any(m.out_features % n == 0 for m in beside):
                widths = ", ".join(str(m.out_features) for m in beside)
                res.errors.add(f"rule '{rule.pattern}': '{path}.{name}' has {n} entries, not "
                               f"one per head of the projections beside it (outputs {widths})",
                               rule.loc)
