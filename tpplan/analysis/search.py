"""``tpplan search``: every layout of a plan at a world size, checked, ranked by estimated
tokens/s per device (:func:`tpplan.analysis.cost.estimate_step`).

Each candidate (:mod:`tpplan.analysis.candidates`) is the plan with a few ``--set`` lines,
and goes through ``validate``'s checks (:class:`tpplan.analysis.tracecache.Evaluator`:
the plan's sections, the model's resolution, the batch against the mesh). In two passes:

1. every candidate that passes the checks gets its communication analysis (TP traced,
   cached by what the trace reads) and a first estimate, with the pipeline's schedule
   facts (bubble, stages) but not yet its point-to-point traffic, which the memory trace
   measures;
2. in the order of that estimate, candidates get the memory analysis (the trainer's step on
   fake tensors, cached) and the device's verdict (:func:`tpplan.analysis.fit.needed`),
   then their communication again with the pipeline's traffic and their final estimate,
   until ``top`` of them fit (``exhaustive``: every one). Those below are counted as not
   checked for memory: they could not rank above the ones shown unless the pipeline's
   point-to-point traffic moved them, which it cannot by more than it costs.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from typing import Any, Callable, Sequence

from ..plan.devices import Device
from .candidates import Options, candidates
from .cost import DEFAULT_CONSTANTS, CostConstants, estimate_step
from .dryrun import DryRun, fake_process_group
from .fit import needed
from .stagemem import pipeline_schedule
from .tracecache import Evaluator

__all__ = ["search", "reason_of"]


def reason_of(message: str) -> str:
    """An error's reason without its numbers: candidates dropped for the same reason count
    together (``... not divisible by the data-parallel size N ...``)."""
    text = re.sub(r"(?<![A-Za-z_])\d+(?:[,.]\d+)*(?![A-Za-z_])", "N", message.split(";")[0])
    return re.sub(r"^--set [^:]*: ", "", text).strip()


def _estimate(result: DryRun, device: Device, gpus_per_node: int,
              constants: CostConstants | None) -> Any:
    try:
        return estimate_step(result, device, gpus_per_node, constants)
    except ValueError as e:
        return str(e)


def _row(c, result: DryRun, est, device: Device) -> dict[str, Any]:
    mem = result.extra["memory_per_rank"]
    need = needed(mem["peak"])
    return dict(sets=c.sets, mesh=dict(pp=c.pp, dp_replicate=c.dp_replicate,
                                       dp_shard=c.dp_shard, tp=c.tp),
                step=result.step.to_json(), peak=mem["peak"], needed=need,
                headroom=device.memory - need, estimate=est.to_json(),
                tokens_per_s_per_device=est.tokens_per_s_per_device, step_time=est.step_time,
                mfu=est.mfu, dominant=est.dominant,
                bubble_fraction=result.extra.get("pipeline", {}).get("bubble_fraction", 0.0))


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
    cands = candidates(ev.base, world_size, options)
    say(f"{len(cands)} candidates")
    dropped: Counter = Counter()
    examples: dict[str, list[str]] = {}

    def drop(reason: str, c) -> None:
        dropped[reason] += 1
        examples.setdefault(reason, c.sets)

    first = []
    with fake_process_group(world_size):
        for c in cands:
            r = ev.check(c.sets)
            if r.errors:
                drop(reason_of(r.errors[0].message), c)
                continue
            if r.plan.spec.pipeline is not None:
                r.extra["pipeline"] = pipeline_schedule(r.plan.spec, r.resolution.dims,
                                                        r.resolution.pipeline)
            ev.comm(r)
            est = _estimate(r, device, gpus_per_node, constants) if r.ok else None
            if not isinstance(est, (type(None), str)):
                first.append((est.tokens_per_s_per_device, len(first), c))
            else:
                drop(f"analysis failed: {est or r.analysis_errors[0].message}", c)
        say(f"{len(first)} pass the checks; memory in the order of the first estimate")
        first.sort(key=lambda t: -t[0])
        fits: list[dict[str, Any]] = []
        unchecked = 0
        for _, _, c in first:
            if len(fits) >= top and not exhaustive:
                unchecked += 1
                continue
            r = ev.check(c.sets)
            ev.memory(r)
            if "error" in r.extra.get("memory_per_rank", {"error": "?"}):
                drop(f"memory analysis failed: {r.analysis_errors[0].message}", c)
                continue
            if needed(r.extra["memory_per_rank"]["peak"]) > device.memory:
                drop(f"does not fit {device.name} memory", c)
                continue
            ev.comm(r)
            est = _estimate(r, device, gpus_per_node, constants)
            if isinstance(est, str):
                drop(f"analysis failed: {est}", c)
                continue
            fits.append(_row(c, r, est, device))
    fits.sort(key=lambda row: -row["tokens_per_s_per_device"])
    return dict(
        plan=plan_path, overrides=list(overrides), world_size=world_size,
        device=device.to_json(), gpus_per_node=gpus_per_node,
        options=dict(max_tp=options.max_tp, ac_every=list(options.ac_every),
                     stages_per_rank=list(options.stages_per_rank),
                     schedules=list(options.schedules)),
        constants=(constants or DEFAULT_CONSTANTS).to_json(),
        candidates=len(cands), passed_checks=len(first), fitting=len(fits),
        not_checked_for_memory=unchecked, ranked=fits[:top] if not exhaustive else fits,
        dropped=[dict(reason=k, count=v, example=examples[k]) for k, v in dropped.most_common()],
        traces=dict(ev.traces), seconds=time.perf_counter() - start)
