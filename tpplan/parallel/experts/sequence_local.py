"""``sequence_local``: a module (a mixture-of-experts block) run on each tp rank's own
sequence shard, as plain tensors (docs/moe.md, "The MoE block on the sequence shard").

Under sequence parallelism the residual stream between a block's sub-layers is sharded on the
sequence. An MoE block routes each token on its own: its router, shared experts and routed
experts need no other token, so the block can run on the shard as it is -- no all-gather
before it, no reduce-scatter after it -- where tpplan's other MoE plans gather the whole
sequence and run the router and the dispatch tp times over the same tokens.

Its parameters (router, shared experts, biases: everything below the module except the
routed experts that ``expert_parallel`` spreads over ``mesh.ep``) are DTensors replicated on
tp, as SequenceParallel's norms are. Each rank's forward sees them as local tensors whose
gradient is ``Partial`` on tp (``to_local(grad_placements=[Partial()])``): each rank's
gradient covers its own tokens, the sum over tp is the whole. FSDP2 redistributes such a
gradient to the parameter's ``Replicate`` before its reduce-scatter (one all-reduce over tp
per parameter and backward); without FSDP the DTensor optimizer step does it. No
reduction is written by hand, and a checkpoint keys them as any replicated parameter.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from ..._torch.modules import own_parameters, swap_around_forward
from ...plan.errors import ErrorList
from ...plan.patterns import enclosing
from ...plan.styles import EP_STYLES, SEQUENCE_LOCAL

__all__ = ["SequenceLocal", "check_sequence_local"]


class SequenceLocal(ParallelStyle):
    """Run a module on this rank's sequence shard as plain tensors, its parameters replicated
    on tp with gradients summed over tp.

    Keyword Args:
        sequence_dim (int): the dimension of the module's input the shard splits; a DTensor
            input must be ``Shard(sequence_dim)`` on tp (default 1).
        skip (tuple[str, ...]): paths below the module (relative) whose parameters are not
            replicated: the routed experts that ``expert_parallel`` spreads over ep.

    Inputs that are DTensors become their local shard; outputs are left as the module
    returns them (this rank's shard, the layout of the residual stream under SP).

    Example::

        >>> parallelize_module(block.mlp, tp_mesh, SequenceLocal(skip=("experts",)))
    """

    def __init__(self, *, sequence_dim: int = 1, skip: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.sequence_dim = sequence_dim
        self.skip = tuple(skip)

    def _owned(self, module: nn.Module) -> list[tuple[nn.Module, str, str]]:
        """(submodule, its parameter's name, that name from ``module``) of each parameter."""
        out = []
        for path, sub in module.named_modules():
            if any(path == s or path.startswith(s + ".") for s in self.skip):
                continue
            out += [(sub, n, f"{path}.{n}" if path else n) for n, _ in sub.named_parameters(recurse=False)]
        return out

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        owned = self._owned(module)
        for sub, name, _ in owned:
            param = own_parameters(sub)[name]
            dt = distribute_tensor(param.detach(), device_mesh, [Replicate()],
                                   src_data_rank=self.src_data_rank)
            sub.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))
        dim, where = self.sequence_dim, type(module).__name__

        def local(x: Any) -> Any:
            if not isinstance(x, DTensor):
                return x
            if x.placements != (Shard(dim),):
                raise ValueError(f"sequence_local: {where} takes its input sharded on dimension "
                                 f"{dim} over tp, got {x.placements}: the plan's rule before "
                                 "it must hand it the sequence shard (sequence parallelism)")
            return x.to_local()

        def local_params(mod: nn.Module) -> dict[str, Any]:
            # FSDP2 has set its unsharded parameters by now: swap in local views of whatever
            # is there, and put it back after the forward (FSDP reshards what it set).
            current = [(path, own_parameters(sub)[name]) for sub, name, path in owned]
            return {path: p.to_local(grad_placements=[Partial()]) for path, p in current
                    if isinstance(p, DTensor)}

        def local_inputs(mod: nn.Module, args: tuple, kwargs: dict):
            return tuple(local(a) for a in args), {k: local(v) for k, v in kwargs.items()}

        swap_around_forward(module, local_params)
        module.register_forward_pre_hook(local_inputs, with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return f"SequenceLocal(sequence_dim={self.sequence_dim}, skip={self.skip})"


def check_sequence_local(res, modules: dict[str, nn.Module], errs: ErrorList) -> None:
    """Located errors for a ``sequence_local`` plan: a rule below such a module other than
    ``expert_parallel`` (the block replicates every parameter below it; a tp-sharded one
    would meet a sequence shard where it expects the whole sequence), and, when the plan
    spreads experts beside it, an ``expert_parallel`` module outside every ``sequence_local``
    block (ep borrows tp's ranks, which would then dispatch the same tokens twice)."""
    blocks = [p for p, r in res.rule_of.items() if r.style.name == SEQUENCE_LOCAL]
    if not blocks:
        return
    for path, rule in res.rule_of.items():
        above = enclosing(path, blocks)
        if above is not None and rule.style.name not in EP_STYLES:
            errs.add(f"module '{path}' is inside '{above}', which runs on the sequence shard "
                     f"({SEQUENCE_LOCAL}: every parameter below it replicated on tp, its "
                     f"gradient summed over tp); rule '{rule.pattern}' ({rule.style.name}) "
                     "cannot shard it there: drop the rule (only expert_parallel may sit "
                     "inside)", rule.loc)
        elif above is None and rule.style.name in EP_STYLES:
            errs.add(f"module '{path}' is spread over ep outside any {SEQUENCE_LOCAL} block, "
                     f"while the plan runs other MoE blocks on the sequence shard, where ep "
                     "borrows tp's ranks: its tp ranks would dispatch the same tokens twice; "
                     f"give its block a {SEQUENCE_LOCAL} rule too, or none of them",
                     rule.loc)
