"""``prepare_input_output``: PyTorch's ``PrepareModuleInputOutput``, with two repairs for
modules run on the whole sequence under sequence parallelism.

A module returning a tuple of one tensor (Inkling 2's block attention residual,
``attn_output.unbind(-2)`` over one query) gets a tuple back: PyTorch's output hook returns
its one entry bare, and ``module(...)[0]`` would then index the batch.

``flat_tokens: true``: a module that returns its tokens flattened.

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

from ...plan.errors import PlanError, PlanErrors
from ...plan.specs import Rule

__all__ = ["PrepareInputOutput", "check_layout_counts"]


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


class PrepareInputOutput(PrepareModuleInputOutput):
    """``PrepareModuleInputOutput`` (same keywords) that keeps a one-tuple output a tuple,
    and with ``flat_tokens=True`` reshards outputs shaped ``(batch × sequence, ...)`` (the
    gathered input's first two dimensions, flattened) as ``(batch, sequence, ...)`` and
    flattens them back.

    Example::

        >>> parallelize_module(layer.feed_forward, tp_mesh, PrepareInputOutput(
        ...     input_layouts=Shard(1), desired_input_layouts=Replicate(), use_local_input=True,
        ...     output_layouts=(Replicate(), None), desired_output_layouts=(Shard(1), None),
        ...     flat_tokens=True))
    """

    def __init__(self, *, flat_tokens: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.flat_tokens = flat_tokens

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        state: dict[str, Any] = {"tokens": None, "flat": set(), "one": False}

        def record(mod, args, kwargs):  # after the input hook: the whole sequence's shape
            state["tokens"] = _tokens(args, kwargs)

        def before(mod, args, output):
            b_s, state["flat"] = state["tokens"], set()
            state["one"] = isinstance(output, tuple) and len(output) == 1

            def one(i, t):
                if self.flat_tokens and isinstance(t, torch.Tensor) and b_s is not None \
                        and 1 <= t.dim() < 3 and t.shape[0] == b_s[0] * b_s[1]:
                    state["flat"].add(i)
                    return t.unflatten(0, b_s)
                return t
            return _each(output, one)

        def after(mod, args, output):
            output = _each(output, lambda i, t: t.flatten(0, 1) if i in state["flat"] else t)
            return (output,) if state["one"] and not isinstance(output, tuple) else output

        self.prepare_module_input._apply(module, device_mesh)
        module.register_forward_pre_hook(record, with_kwargs=True)
        module.register_forward_hook(before)
        self.prepare_module_output._apply(module, device_mesh)
        module.register_forward_hook(after)
        return module


def _count(layouts: Any) -> int | None:
    return None if layouts is None else len(layouts) if isinstance(layouts, list) else 1


def _plural(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def check_layout_counts(module: nn.Module, path: str, rule: Rule) -> None:
    """Hooks, run before the style's own, that turn a ``prepare_*`` rule whose
    ``input_layouts`` / ``output_layouts`` list more or fewer entries than the module is
    called with or returns into :class:`PlanErrors` at the rule's line, naming the module
    and both counts. PyTorch says only "module inputs and input_layouts should have same
    length!"; the number of inputs a module gets is known only when it is called, so the
    check runs in the forward (the dry run's traces find it before any process group)."""
    name, opts = rule.style.name, rule.style.options
    inputs = _count(opts.get("input_layouts")) if name != "prepare_output" else None
    outputs = _count(opts.get("output_layouts")) if name != "prepare_input" else None
    what = f"'{path}' ({type(module).__name__})"

    def fail(message: str) -> None:
        raise PlanErrors([PlanError(message, rule.loc)])

    def check_inputs(mod, args):
        if len(args) != inputs:
            keywords = " (keyword inputs take input_kwarg_layouts)" if name != "prepare_output" \
                else ""
            fail(f"{what} is called with {_plural(len(args), 'positional input')}, but "
                 f"'input_layouts' lists {inputs}: give one layout per positional input, null "
                 f"for one left alone{keywords}")

    def check_outputs(mod, args, output):
        n = len(output) if isinstance(output, tuple) else 1
        if n != outputs:
            fail(f"{what} returns {_plural(n, 'output')}, but 'output_layouts' lists "
                 f"{outputs}: give one layout per output, null for one left alone")

    if inputs is not None:
        module.register_forward_pre_hook(check_inputs, prepend=True)
    if outputs is not None:
        module.register_forward_hook(check_outputs, prepend=True)
