"""Communication per optimizer step: TP (traced), FSDP (from its units), and the minimum.

Bytes are those of each collective's full buffer (an all-gather's output, a reduce-scatter's
input, an all-reduce's tensor); ``wire_bytes`` is what one rank sends with the ring
algorithm: ``2(n-1)/n`` of the buffer for an all-reduce, ``(n-1)/n`` for the others. By that
measure one all-reduce costs exactly one reduce-scatter plus one all-gather, which is why
sequence parallelism is free in bandwidth. Formulas and sources: docs/dry-run.md.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import torch.nn as nn

from ...parallel.fsdp_units import ROOT, UnitSize
from ...parallel.mesh import ParallelDims
from ...parallel.resolve import Resolution
from ...plan.patterns import generalize, is_in_blocks
from ...plan.specs import FSDPSpec, PlanSpec
from ...plan.step import StepShape
from .tp_trace import TPTrace

__all__ = ["fsdp_collectives", "megatron_minimum", "diagnose", "wire_bytes", "rows", "Accumulation",
           "GRADIENTS"]

FP32 = 4

PREPARE = ("prepare_input", "prepare_input_output")


def wire_bytes(kind: str, nbytes: int, n: int) -> int:
    """Bytes one rank sends for a collective over ``n`` ranks (ring algorithm)."""
    if n <= 1:
        return 0
    factor = 2 if kind == "all_reduce" else 1
    return factor * nbytes * (n - 1) // n


def fsdp_collectives(units: list[UnitSize], fsdp: FSDPSpec | None, shape: StepShape,
                     dims: ParallelDims, param_bytes: int, reduce_bytes: int,
                     gathers: Callable[[str], int] | None = None) -> list[dict[str, Any]]:
    """FSDP2 per optimizer step, as the trainer runs it: each micro-batch all-gathers each
    unit in forward (and again in backward when ``reshard_after_forward``; never the root,
    FSDP2 keeps it unsharded); gradients are reduce-scattered once per step (the trainer
    turns gradient sync off until the last micro-batch) and, with HSDP, the gradient shard
    all-reduced over ``dp_replicate`` once; only the parameters that train are reduced
    (:attr:`UnitSize.reduced`: the adapters under LoRA), and units backward never reaches
    are not gathered again (:func:`_no_backward`). ``param_bytes``/``reduce_bytes``: bytes per
    element of the compute and reduce dtypes. ``gathers(unit)``: all-gathers per step where
    a pipeline schedule decides them (:func:`tpplan.analysis.cost.schedule.fsdp_gathers`)."""
    out: list[dict[str, Any]] = []
    if fsdp is None:
        return out
    k = shape.grad_accum
    idle = set() if gathers else _no_backward(units)
    for unit in units:
        name, elems = unit.unit, unit.elements
        again = fsdp.reshard_after_forward and name != ROOT and name not in idle
        n = gathers(name) if gathers else k * (1 + again)
        # dp_shard (dp_shard × cp under context parallelism), or efsdp for an experts
        # module's own unit
        dim = unit.mesh_dim if unit.mesh_dim == "efsdp" else \
            ("dp_shard_cp" if dims.cp > 1 else "dp_shard")
        shards = dims.efsdp if dim == "efsdp" else dims.dp_shard * dims.cp
        reduced = unit.reduced  # what trains: a frozen parameter has no gradient to reduce
        if shards > 1:
            out.append(dict(kind="all_gather", mesh_dim=dim, count=n,
                            bytes=n * elems * param_bytes, unit=name))
            if reduced:
                out.append(dict(kind="reduce_scatter", mesh_dim=dim, count=1,
                                bytes=reduced * reduce_bytes, unit=name))
        if dims.dp_replicate > 1 and reduced:
            out.append(dict(kind="all_reduce", mesh_dim="dp_replicate", count=1,
                            bytes=reduced * reduce_bytes // shards, unit=name))
    return out


def _no_backward(units: list[UnitSize]) -> set[str]:
    """Units that FSDP2 does not all-gather in backward: with nothing trained in them or
    before them (a frozen embedding, frozen first blocks), backward never reaches them,
    except the one just before the first unit that trains, which the first's backward
    prefetches all the same."""
    ordered = sorted(units, key=lambda u: u.order)
    first = next((i for i, u in enumerate(ordered) if u.reduced), len(ordered))
    return {u.unit for u in ordered[:max(first - 1, 0)]}


def _linears(model: nn.Module, res: Resolution, style: str) -> list[tuple[str, nn.Module]]:
    modules = dict(model.named_modules())
    return [(p, modules[p]) for p, r in res.rule_of.items() if r.style.name == style]


def _colwise_chained(model: nn.Module, res: Resolution) -> list[tuple[str, nn.Module]]:
    """Colwise Linears whose declared input is sharded over features (fed by a colwise)."""
    out = []
    for path, m in _linears(model, res, "colwise"):
        layout = res.rule_of[path].style.options.get("input_layouts")
        if isinstance(m, nn.Linear) and getattr(layout, "kind", None) == "shard" and \
                layout.dim not in (0, 1):  # batch or sequence shards are not features
            out.append((path, m))
    return out


def _heads(model: nn.Module, res: Resolution) -> list[tuple[str, nn.Module]]:
    """Colwise Linears outside the repeated blocks that close no colwise group: the head."""
    chained = {p for p, _ in _colwise_chained(model, res)}
    return [(p, m) for p, m in _linears(model, res, "colwise")
            if isinstance(m, nn.Linear) and p not in chained and not is_in_blocks(p)]


def megatron_minimum(model: nn.Module, res: Resolution, plan: PlanSpec, shape: StepShape,
                     e: int, e_grad: int) -> tuple[Counter, Counter]:
    """What a Megatron-style plan needs per optimizer step, as Counter[(kind, backward)] of
    counts and one of bytes alongside; ``e``, ``e_grad``: bytes per element of the compute
    dtype and of the gradients when they are reduced. See docs/dry-run.md for the
    derivation.

    Per micro-batch, per sub-layer (a rowwise Linear closing a colwise group): without SP
    one all-reduce of the residual activation in forward and one in backward; with SP an
    all-gather and a reduce-scatter in each. A rowwise (vocab-parallel) embedding reduces
    its output in forward (SP: reduce-scatter, then all-gather of its gradient). A colwise
    head reduces its input gradient (SP: all-gather in forward, reduce-scatter in
    backward), and loss parallelism adds three all-reduces of one fp32 per token (max,
    sum-exp, target logit; torch/distributed/tensor/parallel/loss.py; the trainer's loss
    is computed on ``logits.float()``). Once per step, with SP, every weight of a
    sequence-parallel module (the norms) has its gradient all-reduced over tp.
    """
    counts: Counter = Counter()
    nbytes: Counter = Counter()
    if res.dims.tp == 1:
        return counts, nbytes
    sp = plan.uses_sequence_parallel
    k = shape.grad_accum
    tokens = shape.micro_batch * shape.seq_len

    def add(kind: str, bw: bool, width: int, element: int = e) -> None:
        counts[(kind, bw)] += k
        nbytes[(kind, bw)] += k * tokens * width * element

    if sp:  # a sequence-parallel module's weights get partial gradients: one all-reduce each
        for _, m in _linears(model, res, "sequence_parallel"):
            for p in m.parameters(recurse=False):
                counts[("all_reduce", True)] += 1
                nbytes[("all_reduce", True)] += p.numel() * e_grad
    rowwise = _linears(model, res, "rowwise")
    for _, m in rowwise:
        if isinstance(m, nn.Embedding):
            add("reduce_scatter" if sp else "all_reduce", False, m.embedding_dim)
            if sp:
                add("all_gather", True, m.embedding_dim)
    closers = [m.out_features for _, m in rowwise if isinstance(m, nn.Linear)]
    # A colwise layer fed a feature-sharded input closes a sub-layer too (wastefully):
    # the minimum counts what a rowwise layer would need in its place.
    closers += [m.out_features for _, m in _colwise_chained(model, res)]
    for width in closers:
        for bw in (False, True):
            if sp:
                add("all_gather", bw, width)
                add("reduce_scatter", bw, width)
            else:
                add("all_reduce", bw, width)
    for _, m in _heads(model, res):
        if sp:
            add("all_gather", False, m.in_features)
        add("reduce_scatter" if sp else "all_reduce", True, m.in_features)
        for _ in range(3):
            add("all_reduce", False, 1, FP32)
    return counts, nbytes


def diagnose(model: nn.Module, res: Resolution, plan: PlanSpec) -> list[dict[str, Any]]:
    """Structural reasons a plan communicates more than the minimum, with expected extras."""
    sp = plan.uses_sequence_parallel
    reasons = []
    colwise = [p for p, m in _linears(model, res, "colwise") if isinstance(m, nn.Linear)]
    by_parent: dict[str, list[str]] = defaultdict(list)
    for path in colwise:
        by_parent[path.rpartition(".")[0]].append(path)
    groups: dict[str, list] = defaultdict(list)
    for parent, kids in by_parent.items():
        rule = res.rule_of.get(parent)
        if len(kids) > 1 and (rule is None or rule.style.name not in PREPARE):
            groups[generalize(parent)].append(kids)
    for parent, instances in groups.items():
        extra = sum(len(k) - 1 for k in instances)
        names = ", ".join(k.rpartition(".")[2] for k in instances[0])
        kinds = ["all_gather (forward)", "reduce_scatter (backward)"] if sp else \
            ["all_reduce (backward)"]
        reasons.append(dict(
            where=parent, extra_count={k: extra for k in kinds},
            reason=f"colwise siblings {names} under '{parent}' share one input but each "
                   f"{'gathers it and ' if sp else ''}reduces its own input gradient: "
                   f"{extra} extra per micro-batch ({len(instances)} × "
                   f"{len(instances[0]) - 1}); add a prepare_input rule on '{parent}' so they "
                   "share one"))
    chained: dict[str, list[str]] = defaultdict(list)
    for path, _ in _colwise_chained(model, res):
        chained[generalize(path)].append(path)
    for where, paths in chained.items():
        opts = res.rule_of[paths[0]].style.options
        out = opts.get("output_layouts")
        gathers = len(paths) * (2 if getattr(out, "kind", None) == "replicate" else 1)
        reasons.append(dict(
            where=where,
            extra_count={"all_gather (forward)": gathers, "reduce_scatter (backward)": len(paths)},
            reason=f"colwise '{where}' takes a feature-sharded input "
                   f"(input_layouts={opts.get('input_layouts')}) from a colwise layer: its input "
                   f"{'and its output are' if gathers > len(paths) else 'is'} all-gathered in "
                   "forward and its input gradient reduce-scattered in backward, where a "
                   "rowwise layer needs one all-reduce per pass; make this layer rowwise"))
    kv = _linears(model, res, "kv_colwise")
    if kv:
        weights = sum(p.numel() * p.element_size() for _, m in kv for p in m.parameters())
        reasons.append(dict(
            where=generalize(kv[0][0]), extra_count={"all_reduce (backward)": len(kv)},
            reason=f"kv_colwise: {len(kv)} key/value projections have fewer heads than tp; "
                   f"their weights are whole on every tp rank ({_size(weights)} per rank, not "
                   f"divided by tp) and each one's gradient is all-reduced over tp once per step "
                   f"({len(kv)} all_reduce, {_size(weights)})"))
    ac = plan.activation_checkpointing
    if ac.enabled and res.ac_blocks:
        n = len(res.ac_blocks[::ac.every])
        reasons.append(dict(
            where=ac.blocks, extra_count={},
            reason=f"activation checkpointing recomputes {n} blocks' forward in backward, "
                   "re-issuing the collectives the recomputed part needs (memory for "
                   "bandwidth: a choice, not a mistake)"))
    if not plan.loss_parallel and res.dims.tp > 1:
        heads = _heads(model, res)
        if heads:
            reasons.append(dict(where=heads[0][0], extra_count={},
                                reason="the logits are gathered over the vocabulary; "
                                       "set 'loss_parallel: true' to compute the loss on shards"))
    return reasons


def _size(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.2f} KiB"


GRADIENTS = "<gradients>"  # the TP trace's module for the reductions after backward


@dataclass(frozen=True)
class Accumulation:
    """How one traced micro-batch's TP collectives add up to an optimizer step.

    The gradient reductions after backward (:data:`GRADIENTS`: a sequence-parallel norm's
    partial gradient made whole) run once per step, when the gradient is reduced;
    everything else once per micro-batch. With gradient accumulation under FSDP2's mixed
    precision, FSDP2 keeps the accumulated gradient in ``reduce_dtype``, so those
    reductions move ``grad_bytes`` bytes per element where the trace (in the compute
    dtype) moved ``trace_bytes``."""

    micro_batches: int
    grad_bytes: int = 1
    trace_bytes: int = 1

    def count(self, module: str) -> int:
        return 1 if module == GRADIENTS else self.micro_batches

    def nbytes(self, module: str, nbytes: int) -> int:
        return nbytes * self.grad_bytes // self.trace_bytes if module == GRADIENTS else nbytes


def rows(trace: TPTrace, fsdp: list[dict], step: Accumulation, dims: ParallelDims) -> list[dict[str, Any]]:
    """Per (source, kind, mesh dimension): count, bytes and wire bytes per optimizer step."""
    acc: dict[tuple, list[int]] = defaultdict(lambda: [0, 0, 0])
    sizes = {"tp": dims.tp, "dp_shard": dims.dp_shard, "dp_replicate": dims.dp_replicate,
             "ep": dims.ep, "efsdp": dims.efsdp, "cp": dims.cp, "dp_shard_cp": dims.dp_shard * dims.cp}
    for (kind, dim, _bw, nbytes, module), n in trace.counts.items():
        a = acc[(dim if dim in ("ep", "cp") else "tp", kind, dim)]
        n *= step.count(module)
        nbytes = step.nbytes(module, nbytes)
        a[0] += n
        a[1] += n * nbytes
        a[2] += n * wire_bytes(kind, nbytes, sizes.get(dim, 1))
    for c in fsdp:
        a = acc[("fsdp", c["kind"], c["mesh_dim"])]
        a[0] += c["count"]
        a[1] += c["bytes"]
        a[2] += wire_bytes(c["kind"], c["bytes"], sizes[c["mesh_dim"]])
    return [dict(source=s, kind=kind, mesh_dim=dim, count=v[0], bytes=v[1], wire_bytes=v[2])
            for (s, kind, dim), v in sorted(acc.items())]
