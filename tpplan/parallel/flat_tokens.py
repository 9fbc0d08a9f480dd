"""``prepare_input_output`` with ``flat_tokens: true``: a module run on the whole sequence
that returns its tokens flattened.

Under sequence parallelism a module that routes tokens (an MoE block) gets the whole sequence
and hands back its shard (``output_layouts: replicate``, ``desired_output_layouts:
shard(1)``). Llama 4's MoE returns ``(batch × sequence, hidden)``: ``shard(1)`` of that
would split the hidden dimension, and the block's ``view(residual.shape)`` would then
silently reinterpret it. With ``flat_tokens`` each output of that flattened shape is viewed
as ``(batch, sequence, ...)`` around the resharding and flattened back: the output is this
rank's tokens, ``(batch × sequence / tp, hidden)``, in the order the block expects.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import PrepareModuleInputOutput

__all__ = ["FlatTokensInputOutput"]


def _tokens(args: tuple, kwargs: dict) -> tuple[int, int] | None:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor) and a.dim() >= 3:
            return tuple(a.shape[:2])
    return None


def _each(output: Any, fn) -> Any:
    """``fn(i, tensor)`` on the output or each entry of a tuple output."""
    if isinstance(output, tuple):
        return tuple(fn(i, o) for i, o in enumerate(output))
    return fn(0, output)


class FlatTokensInputOutput(PrepareModuleInputOutput):
    """``PrepareModuleInputOutput`` whose outputs shaped ``(batch × sequence, ...)`` (the
    gathered input's first two dimensions, flattened) are resharded as ``(batch, sequence,
    ...)`` and flattened back. Same keywords as ``PrepareModuleInputOutput``.

    Example::

        >>> parallelize_module(layer.feed_forward, tp_mesh, FlatTokensInputOutput(
        ...     input_layouts=Shard(1), desired_input_layouts=Replicate(), use_local_input=True,
        ...     output_layouts=(Replicate(), None), desired_output_layouts=(Shard(1), None)))
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        state: dict[str, Any] = {"tokens": None, "flat": set()}

        def record(mod, args, kwargs):  # after the input hook: the whole sequence's shape
            state["tokens"] = _tokens(args, kwargs)

        def unflatten(mod, args, output):
            b_s, state["flat"] = state["tokens"], set()

            def one(i, t):
                if isinstance(t, torch.Tensor) and b_s is not None and 1 <= t.dim() < 3 \
                        and t.shape[0] == b_s[0] * b_s[1]:
                    state["flat"].add(i)
                    return t.unflatten(0, b_s)
                return t
            return _each(output, one)

        def flatten(mod, args, output):
            return _each(output, lambda i, t: t.flatten(0, 1) if i in state["flat"] else t)

        self.prepare_module_input._apply(module, device_mesh)
        module.register_forward_pre_hook(record, with_kwargs=True)
        module.register_forward_hook(unflatten)
        self.prepare_module_output._apply(module, device_mesh)
        module.register_forward_hook(flatten)
        return module
