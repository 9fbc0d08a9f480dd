"""The module table of a dry run (:class:`~tpplan.parallel.report.ApplyReport`'s rows) for
a model of identical blocks, from the plan applied to its first blocks only.

Applying a plan to Llama 3 405B's 126 blocks on meta is a tenth of ``validate``'s time, and
all it shows is a row per module: its rule, style and each parameter's global and local
shape, placements and dtype. Where the blocks are identical (the same module types,
parameter shapes and rules in every one, :func:`~tpplan.analysis.comm.tp_trace.identical_blocks`,
and ``lora`` and ``freeze`` alike in each), a block's rows are another's but for the block's
index in their paths: the plan is applied to a copy holding the first :data:`DEPTH` blocks
(:class:`~tpplan.analysis.memory.step.ModelBuilder`), and the last of them stands for every
block after it. That the rows of the blocks before it are its own, renamed, is checked; where
they are not, or applying the cut copy fails (a pipeline split point past it, say), the plan
is applied to the whole model as before, which reports what is wrong.
"""

from __future__ import annotations

import dataclasses
import time

import torch.nn as nn

from ..api import Plan
from ..parallel.lora.sizes import same_in_every_block
from ..parallel.report import ApplyReport, ModuleRow
from ..parallel.resolve import Resolution
from ..plan import PlanErrors

__all__ = ["DEPTH", "applied_report"]

DEPTH = 3  # blocks applied: the first, and two to compare


def applied_report(plan: Plan, model: nn.Module, res: Resolution, mesh
                   ) -> tuple[ApplyReport, bool]:
    """``(report, parallelized)``: the report of ``plan`` applied to ``model`` (resolved as
    ``res``) on ``mesh``, its rows made while the mesh is up (also left in
    ``plan.last_report``), and whether ``model`` itself was parallelized: only where its
    rows cannot come from a cut copy's."""
    start = time.perf_counter()
    rows = _from_first_blocks(plan, model, res, mesh)
    if rows is None:
        plan.apply(model, mesh)
        _ = plan.last_report.modules
    else:
        plan.last_report = ApplyReport(res, seconds=time.perf_counter() - start, rows=rows)
    return plan.last_report, rows is None


def _from_first_blocks(plan: Plan, model: nn.Module, res: Resolution, mesh
                       ) -> list[ModuleRow] | None:
    """The whole model's rows from a copy of its first :data:`DEPTH` blocks, or None."""
    from ..parallel.apply import apply_plan
    from .memory.step import ModelBuilder
    from .comm.tp_trace import identical_blocks

    found = identical_blocks(model, res.rule_of)
    if found is None or not same_in_every_block(plan.spec, model):
        return None
    blocks, container = found[2], getattr(found[0], found[1])
    n = len(container)
    if n <= DEPTH or [name for name, _ in container.named_children()] != \
            [str(i) for i in range(n)]:
        return None  # (a block's index is its name where the rows are renamed)
    try:
        rows = apply_plan(plan.spec, ModelBuilder(lambda: model, model)(DEPTH), mesh).modules
    except PlanErrors:
        return None
    before, own, after = _by_block(rows, blocks)
    if sorted(own) != list(range(DEPTH)):
        return None
    last = own[DEPTH - 1]
    if any(_renamed(own[i], blocks, i, DEPTH - 1) != last for i in range(1, DEPTH - 1)):
        return None  # the blocks' rows differ by more than their index
    copies = [row for i in range(DEPTH, n) for row in _renamed(last, blocks, DEPTH - 1, i)]
    return before + [row for i in range(DEPTH) for row in own[i]] + copies + after


def _by_block(rows: list[ModuleRow], blocks: str) -> tuple[list, dict[int, list], list]:
    """``(before, own, after)``: the rows before the blocks, each block's by its index, and
    the rows after them (in ``named_modules`` order: a block's rows are contiguous)."""
    before: list[ModuleRow] = []
    own: dict[int, list[ModuleRow]] = {}
    after: list[ModuleRow] = []
    prefix = blocks + "."
    for row in rows:
        index = row.path[len(prefix):].partition(".")[0] if row.path.startswith(prefix) else ""
        if index.isdigit():
            own.setdefault(int(index), []).append(row)
        else:
            (after if own else before).append(row)
    return before, own, after


def _renamed(rows: list[ModuleRow], blocks: str, i: int, j: int) -> list[ModuleRow]:
    """Block ``i``'s rows as block ``j``'s: the index in each path replaced."""
    old, new = f"{blocks}.{i}", f"{blocks}.{j}"
    return [dataclasses.replace(r, path=new + r.path[len(old):]) for r in rows]
