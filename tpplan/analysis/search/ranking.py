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
2. its communication analysis (TP traced, cached by what the trace reads) and a first
   estimate, without the pipeline's point-to-point traffic (which the memory trace
   measures): a tighter bound;
3. then the memory analysis (the trainer's step on fake tensors, cached; a pipeline's
   stages until a pp rank does not fit, the rank with the highest first-forward bound
   first) and the device's verdict
   (:func:`tpplan.analysis.memory.fit.needed`), its communication again with the pipeline's
   traffic and its final estimate. A layout another data-parallel split of which was
   traced is dropped untraced when :func:`split_free` of that trace (the bytes no split
   changes) does not fit already;

each result goes back into the queue under its new figure, and a final estimate taken
from the queue's front is ranked. Every bound is at most the final step time, so once
``top`` are ranked no candidate left can beat them: the ranking is exactly that of
estimating every candidate (``exhaustive`` does). The ones left are counted, by how far
they were analysed.
"""

from __future__ import annotations

import heapq
import re
import time
from collections import Counter
from typing import Any, Callable, Sequence

from ...models.introspect import find_blocks
from ...plan.devices import Device
from .candidates import Options, candidates
from ..analyses import fsdp_rows, traced_rows
from ..cost.step_time import DEFAULT_CONSTANTS, CostConstants, estimate_step, flops_of, step_time_bound
from ..dryrun import DryRun, fake_process_group
from ..memory.fit import needed
from ..comm.stage_bound import interior_rows
from ..memory.floor import smallest_element
from ..memory.stages import pipeline_schedule
from .trace_cache import Evaluator

__all__ = ["search", "reason_of", "split_free", "sharded_state"]


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


SPLIT_FREE = ("activations", "accumulated_gradients", "transients")


def split_free(memory: dict[str, Any]) -> int:
    """The bytes at the peak of ``memory`` (``memory_per_rank``) that the data-parallel split
    (dp_replicate × dp_shard at a fixed product) does not change: activations, temporaries
    and the unsharded gradients kept between micro-batches. Another split of the same layout
    runs the same operations on the same activations, so at that moment it holds these bytes
    and its own parameter shards and optimizer state: its peak is at least this."""
    return sum(memory["at_peak"][p] for p in SPLIT_FREE)


def sharded_state(result: DryRun, units: list | None, size: int | None = None) -> int:
    """A lower bound, from arithmetic alone, of the bytes every moment of ``result``'s step
    holds on its busiest rank: rank 0's padded FSDP2 shard of every unit (``units``, from
    shapes: :func:`tpplan.parallel.fsdp_units.unit_sizes`), in the smallest parameter dtype,
    and AdamW's two moments of each where every parameter is trained. 0 under a pipeline
    (``units`` None: a stage's units are its own). ``size``: that dtype's bytes, where the
    caller has them (:func:`tpplan.analysis.memory.floor.smallest_element`)."""
    if not units:
        return 0
    dims = result.resolution.dims
    shards = {"dp_shard": dims.dp_shard * dims.cp, "efsdp": dims.efsdp}
    elements = sum(u.elements // shards.get(u.mesh_dim, 1) for u in units)
    size = smallest_element(result.model) if size is None else size
    spec = result.plan.spec
    trained = spec.lora is None and not spec.freeze  # else AdamW holds only what is trained
    return elements * size * (3 if trained else 1)


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
    dropped: Counter = Counter()
    examples: dict[str, list[str]] = {}
    flops: list = []  # the model's FLOPs, the same for every candidate
    size = smallest_element(ev.model)  # its smallest parameter dtype (every candidate's model)

    def too_large(peak: int) -> bool:
        return needed(peak) > device.memory

    def drop(reason: str, c) -> None:
        dropped[reason] += 1
        examples.setdefault(reason, c.sets)

    def checked(c) -> DryRun | None:
        r = ev.check(c.sets)
        if r.errors:
            drop(reason_of(r.errors[0].message), c)
            return None
        if r.plan.spec.pipeline is not None:
            r.extra["pipeline"] = pipeline_schedule(r.plan.spec, r.resolution.dims,
                                                    r.resolution.pipeline)
        if not flops:
            flops.append(flops_of(r))
        return r

    def estimated(r: DryRun, c) -> Any:
        ev.comm(r)
        est = _estimate(r, device, gpus_per_node, constants, flops[0]) if r.ok else None
        if isinstance(est, (type(None), str)):
            drop(f"analysis failed: {est or r.analysis_errors[0].message}", c)
            return None
        return est

    queue: list[tuple[float, int, int, Any, Any]] = []  # (step time bound, order, level, ...)
    with fake_process_group(world_size):
        for i, c in enumerate(cands):
            r = checked(c)
            if r is not None:
                queue.append((step_time_bound(r, device, constants, flops[0]), i, 0, c, None))
        passed = len(queue)
        say(f"{passed} pass the checks; analysed best first")
        heapq.heapify(queue)
        ranked: list[dict[str, Any]] = []
        fitting = analysed = 0
        floors: dict[tuple, int] = {}  # split_free's largest, per layout but its dp split
        unrecomputed: dict[tuple, list] = {}  # traced_rows, per layout without checkpointing
        while queue and (exhaustive or len(ranked) < top):
            bound, i, level, c, row = heapq.heappop(queue)
            if level == 3:
                ranked.append(row)
                continue
            analysed += 1
            if analysed % 100 == 0:
                say(f"{analysed} analyses, {fitting} fit, {len(ranked)} ranked; bound "
                    f"{bound:.3g} s, {len(queue)} queued; traces {dict(ev.traces)}")
            r = checked(c)
            if level <= 1 and not exhaustive:  # arithmetic alone, before any trace of its own
                if level == 0:
                    if needed(sharded_state(r, ev.fsdp_units(r), size)) > device.memory:
                        drop(f"does not fit {device.name} memory: its parameter shards and "
                             "AdamW state alone (arithmetic, nothing traced)", c)
                        continue
                    row = fsdp_rows(r, ev.stages)  # kept in the queue for the next look
                # The FSDP and DP terms, from the units alone, and TP rows the layout's own
                # trace holds where they are known (the highest bound of them): those of
                # its twin without checkpointing, or a pipeline's stages' interior periods
                # from the whole model's trace (with its checkpointing, and without).
                known = [unrecomputed.get(_but_checkpointing(c))]
                if c.pp > 1:
                    known += [interior_rows(r, ev.tp_traces, ev.stages, plain) for plain in
                              {False, r.plan.spec.activation_checkpointing.enabled}]
                tighter = max(step_time_bound(r, device, constants, flops[0], row,
                                              gpus_per_node, rows) for rows in
                              [rows for rows in known if rows] or [None])
                if tighter > bound:
                    heapq.heappush(queue, (tighter, i, 1, c, row))
                    continue
            if level == 2:
                split = (c.pp, c.cp, c.ep, c.tp, *c.sets[1:])  # all but the data-parallel split
                # The two lower bounds only skip traces: ``exhaustive`` traces every layout.
                if not exhaustive and split in floors and \
                        needed(floors[split] + sharded_state(r, ev.fsdp_units(r), size)) > device.memory:
                    drop(f"does not fit {device.name} memory: the part no data-parallel "
                         "split changes (traced for another split) and its own sharded "
                         "state are too large", c)
                    continue
                if not exhaustive and too_large(_floor(ev, r, too_large)):
                    drop(f"does not fit {device.name} memory: already at the end of the first "
                         "forward (its step not traced further)", c)
                    continue
                # A pipeline's stages traced until a pp rank shows it does not fit.
                ev.memory(r, None if exhaustive else too_large)
                mem = r.extra.get("memory_per_rank", {"error": "?"})
                if "error" in mem:
                    drop(f"memory analysis failed: {r.analysis_errors[0].message}", c)
                    continue
                floors[split] = max(floors.get(split, 0), split_free(mem))
                if needed(mem["peak"]) > device.memory:
                    drop(f"does not fit {device.name} memory", c)
                    continue
            est = estimated(r, c)
            if est is not None:
                if not r.plan.spec.activation_checkpointing.enabled:
                    unrecomputed[_but_checkpointing(c)] = traced_rows(r)
                fitting += level == 2
                heapq.heappush(queue, (est.step_time, i, 3 if level == 2 else 2, c,
                                       _row(c, r, est, device) if level == 2 else None))
    left = Counter(q[2] for q in queue)
    return dict(
        plan=plan_path, overrides=list(overrides), world_size=world_size,
        device=device.to_json(), gpus_per_node=gpus_per_node,
        options=dict(max_tp=options.max_tp, ac_every=list(options.ac_every),
                     stages_per_rank=list(options.stages_per_rank),
                     schedules=list(options.schedules)),
        constants=(constants or DEFAULT_CONSTANTS).to_json(),
        candidates=len(cands), passed_checks=passed, fitting=fitting,
        not_ranked=dict(bound_only=left[0] + left[1], comm_only=left[2], fitting=left[3]),
        ranked=ranked,
        dropped=[dict(reason=k, count=v, example=examples[k]) for k, v in dropped.most_common()],
        traces=dict(ev.traces), seconds=time.perf_counter() - start)
