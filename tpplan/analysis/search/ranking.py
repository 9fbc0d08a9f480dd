"""``tpplan search``: every layout of a plan at a world size, checked, ranked by estimated
tokens/s per device (:func:`tpplan.analysis.cost.step_time.estimate_step`).

Each candidate (:mod:`tpplan.analysis.search.candidates`) is the plan with a few ``--set`` lines,
and goes through ``validate``'s checks (:class:`tpplan.analysis.search.trace_cache.Evaluator`:
the plan's sections, the model's resolution, the batch against the mesh). The analyses are
then run best first (branch and bound), each candidate as far as its bound asks:

0. every candidate that passes the checks gets a bound from arithmetic alone
   (:func:`tpplan.analysis.cost.step_time.step_time_bound`: compute, recompute, the schedule's bubble);
1. at the front of the queue, dropped if its sharded state alone does not fit; else the
   bound with the FSDP and DP terms too (FSDP2's units, no trace: :func:`tpplan.analysis.
   fsdp_rows`) and, for a layout with activation checkpointing, the TP, ep and cp terms of
   the same layout without it where that one's communication was analysed (recomputation
   issues every collective of the step without it, and more: :func:`tpplan.analysis.
   traced_rows`), or for a pipeline those of its stages' interior periods where the whole
   model's trace ran (:func:`tpplan.analysis.comm.stage_bound.interior_rows`), back into the queue
   where that is higher (and looked at again there, as such a trace may have run since);
2. its communication analysis (TP traced, cached by what the trace reads), its non-GEMM
   kernels traced (:func:`tpplan.analysis.analyses.analyze_kernels`, cached by what the trace
   reads: :mod:`tpplan.analysis.search.kernel_cache`) and a first estimate,
   without the pipeline's point-to-point traffic (which the memory trace measures): a
   tighter bound;
3. then the memory analysis (the trainer's step on fake tensors, cached; a pipeline's
   stages until a pp rank does not fit, the rank with the highest first-forward bound
   first) and the device's verdict
   (:func:`tpplan.analysis.memory.fit.needed`), its communication again with the pipeline's
   traffic and its final estimate. A layout another data-parallel split of which was
   traced is dropped untraced when :func:`.bounds.split_free` of that trace (the bytes no split
   changes) does not fit already;

a layout without checkpointing dropped there for memory brings its twin with per-operator
checkpointing into the queue (:func:`.candidates.op_twin`); each result goes back into the
queue under its new figure, and a final estimate taken from the queue's front is ranked.
Every bound is at most the final step time, so once ``top`` are ranked no candidate left
can beat them: the ranking is exactly that of estimating every candidate (``exhaustive``
does, one trace of each step for its kernels and memory). Those left are counted by stage.
"""

from __future__ import annotations

import heapq
import re
import time
from collections import Counter
from enum import IntEnum
from typing import Any, Callable, Sequence

from ...models.introspect import find_blocks
from ...plan.devices import Device
from .candidates import Options, ac_settings, candidates, op_twin
from .kernel_cache import KernelCache
from ..analyses import fsdp_rows, traced_rows
from ..cost.step_time import DEFAULT_CONSTANTS, CostConstants, estimate_step, flops_of, step_time_bound
from ..dryrun import DryRun, fake_process_group
from ..memory.fit import needed
from ..comm.stage_bound import interior_rows
from ..memory.floor import smallest_element
from ..memory.step import shared_steps
from ..memory.stages import pipeline_schedule
from .bounds import sharded_state, split_free
from .trace_cache import Evaluator

__all__ = ["Stage", "search", "reason_of"]


def reason_of(message: str) -> str:
    """An error's reason without its numbers: candidates dropped for the same reason count
    together (``... not divisible by the data-parallel size N ...``)."""
    text = re.sub(r"(?<![A-Za-z_])\d+(?:[,.]\d+)*(?![A-Za-z_])", "N", message.split(";")[0])
    return re.sub(r"^--set [^:]*: ", "", text).strip()


def _estimate(result: DryRun, device: Device, gpus_per_node: int,
              constants: CostConstants | None, flops) -> Any:
    try:
        return estimate_step(result, device, gpus_per_node, constants, flops)
    except ValueError as e:
        return str(e)


def _row(c, result: DryRun, est, device: Device) -> dict[str, Any]:
    mem = result.extra["memory_per_rank"]
    need = needed(mem["peak"])
    return dict(sets=c.sets, mesh=dict(pp=c.pp, dp_replicate=c.dp_replicate,
                                       dp_shard=c.dp_shard, cp=c.cp, ep=c.ep, tp=c.tp),
                step=result.step.to_json(), peak=mem["peak"], needed=need,
                headroom=device.memory - need, estimate=est.to_json(),
                tokens_per_s_per_device=est.tokens_per_s_per_device, step_time=est.step_time,
                mfu=est.mfu, dominant=est.dominant,
                bubble_fraction=result.extra.get("pipeline", {}).get("bubble_fraction", 0.0))


def _but_checkpointing(c) -> tuple:
    """A candidate's ``--set`` lines less its checkpointing (the second): the same for a
    layout and its variants with recomputation."""
    return (c.sets[0], *c.sets[2:])


def _floor(ev: Evaluator, result: DryRun, over: Callable[[int], bool]) -> int:
    """:meth:`Evaluator.floor`, or 0 where the first forward cannot run (the whole trace
    then reports why, as ``validate`` does)."""
    try:
        return ev.floor(result, over)
    except Exception:  # noqa: BLE001 - the memory analysis names the failure
        return 0


class Stage(IntEnum):
    """How far a queued candidate was analysed (the module docstring's steps 0-3): the third
    key of the queue, after its bound and the candidate's order."""
    CHECKED = 0  # passed the checks: its bound from arithmetic alone
    BOUNDED = 1  # its bound with the FSDP and DP terms and the TP rows known so far
    COMMUNICATED = 2  # its communication analysed: a first estimate, without p2p traffic
    RANKED = 3  # its memory analysed and fitting: its final estimate, ranked once popped


class _Search:
    """One search's state: the evaluator, what was dropped and why, and what the traces so
    far tell the bounds of the candidates still queued."""

    def __init__(self, ev: Evaluator, device: Device, gpus_per_node: int, constants: CostConstants | None,
                 exhaustive: bool, acs: list[str] | None = None, first_twin: int = 0):
        self.ev, self.device, self.gpus_per_node = ev, device, gpus_per_node
        self.acs, self.first_twin, self.twins = acs, first_twin, 0  # op twins: their settings, order
        self.constants, self.exhaustive = constants, exhaustive
        self.dropped: Counter = Counter()
        self.examples: dict[str, list[str]] = {}
        self.flops: list = []  # the model's FLOPs, the same for every candidate
        self.size = smallest_element(ev.model)  # its smallest parameter dtype (every candidate's model)
        self.floors: dict[tuple, int] = {}  # split_free's largest, per layout but its dp split
        self.unrecomputed: dict[tuple, list] = {}  # traced_rows, per layout without checkpointing
        self.kernels: dict[tuple, Any] = {}  # analyze_kernels' profile (None: failed), per candidate
        self.kernel_traces = KernelCache(ev.traces)  # the profiles, shared by what their traces read

    def too_large(self, peak: int) -> bool:
        return needed(peak) > self.device.memory

    def drop(self, reason: str, c) -> None:
        self.dropped[reason] += 1
        self.examples.setdefault(reason, c.sets)
        self.last = reason

    def checked(self, c) -> DryRun | None:
        r = self.ev.check(c.sets)
        if r.errors:
            self.drop(reason_of(r.errors[0].message), c)
            return None
        if r.plan.spec.pipeline is not None:
            r.extra["pipeline"] = pipeline_schedule(r.plan.spec, r.resolution.dims,
                                                    r.resolution.pipeline)
        if not self.flops:
            self.flops.append(flops_of(r))
        return r

    def estimated(self, r: DryRun, c) -> Any:
        """The estimate: its communication analysed and, the first time, the step's non-GEMM
        kernels traced where the device prices them (once: the first estimate and the final
        one price the same kernels, or both fall back on ``compute_efficiency``; the traces
        cached by what they read, :mod:`.kernel_cache`)."""
        self.ev.comm(r)
        if self.device.memory_bandwidth and r.ok and tuple(c.sets) not in self.kernels:
            try:
                self.kernel_traces(r)
            except Exception:  # noqa: BLE001 - without the term, compute_efficiency stands for it
                pass
            self.kernels[tuple(c.sets)] = r.extra.get("kernels")
        r.extra["kernels"] = self.kernels.get(tuple(c.sets))
        est = _estimate(r, self.device, self.gpus_per_node, self.constants, self.flops[0]) if r.ok else None
        if isinstance(est, (type(None), str)):
            self.drop(f"analysis failed: {est or r.analysis_errors[0].message}", c)
            return None
        return est

    def tighter(self, r: DryRun, c, row: Any) -> float:
        """The FSDP and DP terms, from the units alone, and TP rows the layout's own trace
        holds where they are known (the highest bound of them): those of its twin without
        checkpointing, or a pipeline's stages' interior periods from the whole model's trace
        (with its checkpointing, and without)."""
        known = [self.unrecomputed.get(_but_checkpointing(c))]
        if c.pp > 1:
            known += [interior_rows(r, self.ev.tp_traces, self.ev.stages, plain) for plain in
                      {False, r.plan.spec.activation_checkpointing.enabled}]
        return max(step_time_bound(r, self.device, self.constants, self.flops[0], row,
                                   self.gpus_per_node, rows) for rows in
                   [rows for rows in known if rows] or [None])

    def fits(self, r: DryRun, c) -> bool:
        """The memory analysis, after the lower bounds that skip it; False (``c`` dropped)
        where the candidate does not fit the device or its analysis failed."""
        ev, device = self.ev, self.device
        split = (c.pp, c.cp, c.ep, c.tp, *c.sets[1:])  # all but the data-parallel split
        # The two lower bounds only skip traces: ``exhaustive`` traces every layout.
        if not self.exhaustive and split in self.floors and \
                needed(self.floors[split] + sharded_state(r, ev.fsdp_units(r), self.size)) > device.memory:
            self.drop(f"does not fit {device.name} memory: the part no data-parallel "
                      "split changes (traced for another split) and its own sharded "
                      "state are too large", c)
            return False
        if not self.exhaustive and self.too_large(_floor(ev, r, self.too_large)):
            self.drop(f"does not fit {device.name} memory: already at the end of the first "
                      "forward (its step not traced further)", c)
            return False
        # A pipeline's stages traced until a pp rank shows it does not fit.
        ev.memory(r, None if self.exhaustive else self.too_large)
        mem = r.extra.get("memory_per_rank", {"error": "?"})
        if "error" in mem:
            self.drop(f"memory analysis failed: {r.analysis_errors[0].message}", c)
            return False
        self.floors[split] = max(self.floors.get(split, 0), split_free(mem))
        if needed(mem["peak"]) > device.memory:
            self.drop(f"does not fit {device.name} memory", c)
            return False
        return True

    def walk(self, queue: list, top: int, say: Callable[[str], None]) -> tuple[list[dict[str, Any]], int]:
        """Pop the queue best first, each candidate analysed one stage further and pushed
        back under its new figure, until ``top`` are ranked (every one if ``exhaustive``).
        Returns the ranked rows and how many candidates fit."""
        ev, ranked = self.ev, []
        fitting = analysed = 0
        while queue and (self.exhaustive or len(ranked) < top):
            bound, i, stage, c, row = heapq.heappop(queue)
            if stage == Stage.RANKED:
                ranked.append(row)
                continue
            analysed += 1
            if analysed % 100 == 0:
                say(f"{analysed} analyses, {fitting} fit, {len(ranked)} ranked; bound "
                    f"{bound:.3g} s, {len(queue)} queued; traces {dict(ev.traces)}")
            r = self.checked(c)
            if stage <= Stage.BOUNDED and not self.exhaustive:  # arithmetic alone, before any trace of its own
                if stage == Stage.CHECKED:
                    if needed(sharded_state(r, ev.fsdp_units(r), self.size)) > self.device.memory:
                        self.drop(f"does not fit {self.device.name} memory: its parameter shards and "
                                  "AdamW state alone (arithmetic, nothing traced)", c)
                        continue
                    row = fsdp_rows(r, ev.stages)  # kept in the queue for the next look
                tighter = self.tighter(r, c, row)
                if tighter > bound:
                    heapq.heappush(queue, (tighter, i, Stage.BOUNDED, c, row))
                    continue
            if stage == Stage.COMMUNICATED and not self.fits(r, c):
                twin = self.acs and self.last.startswith("does not fit") and op_twin(c, self.acs)
                if twin and (t := self.checked(twin)) is not None:
                    self.twins += 1  # ordered after every candidate, by its own layout's order
                    heapq.heappush(queue, (step_time_bound(t, self.device, self.constants, self.flops[0]),
                                           self.first_twin + i, Stage.CHECKED, twin, None))
                continue
            est = self.estimated(r, c)
            if est is not None:
                if not r.plan.spec.activation_checkpointing.enabled:
                    self.unrecomputed[_but_checkpointing(c)] = traced_rows(r)
                last = stage == Stage.COMMUNICATED
                fitting += last
                heapq.heappush(queue, (est.step_time, i, Stage.RANKED if last else Stage.COMMUNICATED, c,
                                       _row(c, r, est, self.device) if last else None))
        return ranked, fitting


def search(plan_path: str, world_size: int, device: Device, overrides: Sequence[str] = (),
           gpus_per_node: int = 8, options: Options | None = None, top: int = 10,
           constants: CostConstants | None = None, exhaustive: bool = False,
           progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Rank the layouts of the plan at ``plan_path`` (with ``overrides``) on ``world_size``
    ``device``s, ``gpus_per_node`` to a node; the ``top`` that fit, and why the others
    were dropped. Raises :class:`tpplan.plan.PlanErrors` when the plan itself is wrong."""
    start = time.perf_counter()
    options = options or Options(max_tp=gpus_per_node)
    say = progress or (lambda _: None)
    ev = Evaluator(plan_path, overrides, world_size)
    blocks = find_blocks(ev.model)
    cands = candidates(ev.base, world_size, options, blocks and f"{blocks}.*")
    say(f"{len(cands)} candidates")
    acs = ac_settings(ev.base, options.ac_every, blocks and f"{blocks}.*") if options.op else None
    state = _Search(ev, device, gpus_per_node, constants, exhaustive, acs, len(cands))
    queue: list[tuple[float, int, Stage, Any, Any]] = []  # (step time bound, order, stage, candidate, row)
    with fake_process_group(world_size), shared_steps(exhaustive):  # every candidate: both analyses
        for i, c in enumerate(cands):
            r = state.checked(c)
            if r is not None:
                queue.append((step_time_bound(r, device, constants, state.flops[0]), i, Stage.CHECKED, c, None))
        passed = len(queue)
        say(f"{passed} pass the checks; analysed best first")
        heapq.heapify(queue)
        ranked, fitting = state.walk(queue, top, say)
    left = Counter(q[2] for q in queue)
    return dict(
        plan=plan_path, overrides=list(overrides), world_size=world_size,
        device=device.to_json(), gpus_per_node=gpus_per_node,
        options=dict(max_tp=options.max_tp, ac_every=list(options.ac_every),
                     stages_per_rank=list(options.stages_per_rank),
                     schedules=list(options.schedules)),
        constants=(constants or DEFAULT_CONSTANTS).to_json(),
        candidates=len(cands), op_twins=state.twins, passed_checks=passed, fitting=fitting,
        not_ranked=dict(bound_only=left[Stage.CHECKED] + left[Stage.BOUNDED], comm_only=left[Stage.COMMUNICATED],
                        fitting=left[Stage.RANKED]),
        ranked=ranked,
        dropped=[dict(reason=k, count=v, example=state.examples[k]) for k, v in state.dropped.most_common()],
        traces=dict(ev.traces), seconds=time.perf_counter() - start)
