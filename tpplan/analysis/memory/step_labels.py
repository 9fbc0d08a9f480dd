"""Where a step is when memory is observed: the labels of its moments.

:class:`Where` names the current moment ``<micro-batch>/<pass>/<module>`` for
:class:`~tpplan.analysis.memory.tracker.MemoryTracker` (:mod:`tpplan.analysis.memory.step` runs the
step): in forward by module hooks, in backward through autograd's own nodes.
"""

from __future__ import annotations

import bisect

import torch
import torch.nn as nn

from ..._torch.autograd import current_autograd_node, in_backward, sequence_nr
from ..._torch.dispatch import tree_flatten

__all__ = ["Where"]


class Where:
    """The label of the current moment: the step's position, and the module running.

    In forward, global module hooks keep the stack of labelled modules (the blocks, and
    the modules outside them at their outermost level). Backward is attributed through
    autograd itself: each labelled module's forward opens a range of autograd sequence
    numbers (from the newest node among its inputs), and the node autograd is executing
    (``torch._C._current_autograd_node``) falls in one of them. No tensor is held: a
    tracker must not change the memory it measures.
    """

    def __init__(self, model: nn.Module, blocks: str | None, period: int):
        self.root = model
        self.stage = "setup"
        self.mark: str | None = None
        self.labels: dict[int, str] = {}  # id(module) -> label
        children = list(model.get_submodule(blocks).children()) if blocks is not None else []
        depth = len(children)
        for i, block in enumerate(children):
            # Only blocks next to the ends behave differently (their neighbours are not
            # blocks); in between, a moment is linear in the block's index within each
            # residue of the period, so its largest is at the ends of that stretch.
            place = f"head{i}" if i < 2 * period else \
                f"tail{depth - 1 - i}" if i >= depth - 2 * period else "middle"
            self.labels[id(block)] = f"{blocks}.{place}"
        for path, m in model.named_modules():
            inside = blocks is not None and path.startswith(blocks + ".")
            above = blocks is not None and (path == blocks or blocks.startswith(path + ".")
                                            or path == "")
            parent = path.rpartition(".")[0]
            if not (inside or above or path == "") and \
                    id(model.get_submodule(parent)) not in self.labels:
                self.labels[id(m)] = path
        self.labels.pop(id(model), None)
        self.forward_started()

    def forward_started(self) -> None:
        self.stack: list[str] = []
        self.starts: list[int] = []  # autograd sequence numbers where each range begins
        self.names: list[str] = []
        self.high = -1
        self.done = False
        self.last_backward = "<loss>"

    def _seen(self, tensors) -> int:
        high = self.high
        for t in tree_flatten(tensors)[0]:
            fn = getattr(t, "grad_fn", None) if isinstance(t, torch.Tensor) else None
            if fn is not None:
                high = max(high, sequence_nr(fn))
        return high

    def _pre(self, module, args) -> None:
        if in_backward():
            return  # a checkpointed block recomputed in backward: backward is labelled by node
        label = self.labels.get(id(module))
        if label is not None:
            self.high = self._seen(args)
            self.stack.append(label)
            self.starts.append(self.high)
            self.names.append(label)

    def _post(self, module, args, output) -> None:
        if in_backward():
            return
        if id(module) in self.labels:
            self.stack.pop()
            self.high = self._seen(output)
        elif module is self.root:
            self.done = True
            self.starts.append(self._seen(output))
            self.names.append("<loss>")

    def __enter__(self):
        from torch.nn.modules.module import (register_module_forward_hook,
                                             register_module_forward_pre_hook)

        self._hooks = [register_module_forward_pre_hook(self._pre),
                       register_module_forward_hook(self._post)]
        return self

    def __exit__(self, *args) -> None:
        for h in self._hooks:
            h.remove()

    def _backward(self) -> str:
        node = current_autograd_node()
        # Gradient accumulation into a leaf has no place in forward's order: keep the last.
        if node is not None and type(node).__name__ != "AccumulateGrad":
            i = bisect.bisect_left(self.starts, sequence_nr(node)) - 1
            self.last_backward = self.names[i] if i >= 0 else "<root>"
        return self.last_backward

    def __call__(self) -> str:
        if self.mark is not None:
            return f"{self.stage}/mark/{self.mark}"
        if self.stage in ("setup", "optimizer"):
            return self.stage
        if in_backward():
            return f"{self.stage}/backward/{self._backward()}"
        where = self.stack[-1] if self.stack else "<loss>" if self.done else "<root>"
        return f"{self.stage}/forward/{where}"
