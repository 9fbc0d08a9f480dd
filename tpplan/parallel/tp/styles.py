"""StyleSpec -> ``torch.distributed.tensor.parallel`` style objects."""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from ...plan.styles import TPPLAN_OPTIONS, Layout, StyleSpec
from .head_params import HeadParamsParallel
from .prepare_io import PrepareInputOutput
from .kv_heads import KVColwiseParallel
from .latent import LatentKVParallel

__all__ = ["ReplicateParallel", "build_style"]


class ReplicateParallel(ParallelStyle):
    """Make every parameter of a module a DTensor replicated on the tp dimension.

    Inputs and outputs are left as they are. Useful for modules whose weights every tp rank
    needs whole (a norm outside the sequence-parallel region, a router), so that their
    gradients are DTensors like all others and FSDP shards them over the 2-D mesh uniformly.

    Example::

        >>> parallelize_module(model.norm, tp_mesh, ReplicateParallel())
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def replicate_params(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, param in list(mod.named_parameters(recurse=False)):
                dt = distribute_tensor(param, mesh, [Replicate()], src_data_rank=self.src_data_rank)
                mod.register_parameter(pname, nn.Parameter(dt, requires_grad=param.requires_grad))

        return distribute_module(module, device_mesh, replicate_params)

    def __repr__(self) -> str:
        return "ReplicateParallel()"


def _torch(value: Any) -> Any:
    if isinstance(value, Layout):
        return value.to_torch()
    if isinstance(value, list):
        return tuple(_torch(v) for v in value)
    if isinstance(value, dict):
        return {k: _torch(v) for k, v in value.items()}
    return value


_CLASSES = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "sequence_parallel": SequenceParallel,
    "prepare_input": PrepareModuleInput,
    "prepare_output": PrepareModuleOutput,
    "prepare_input_output": PrepareModuleInputOutput,
    "replicate": ReplicateParallel,
    "kv_colwise": KVColwiseParallel,
    "mla_kv_a_proj": LatentKVParallel,
}


def build_style(spec: StyleSpec) -> ParallelStyle:
    """The PyTorch style object for a parsed rule, options passed under their own names."""
    kwargs = {k: _torch(v) for k, v in spec.options.items() if k not in TPPLAN_OPTIONS}
    heads = spec.options.get("head_params")
    if spec.name == "local_params":
        return HeadParamsParallel(head_params=heads)
    if spec.name == "prepare_input_output":
        style = PrepareInputOutput(flat_tokens=bool(spec.options.get("flat_tokens")), **kwargs)
    else:
        style = _CLASSES[spec.name](**kwargs)
    return HeadParamsParallel(head_params=heads, inner=style) if heads else style
