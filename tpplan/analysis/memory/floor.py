"""A lower bound of a layout's memory peak from the first forward of its step alone.

``tpplan search`` meets many layouts that do not fit (no or selective checkpointing at low
tp, large micro-batches); tracing each one's whole step to find that out was most of its
time. :func:`memory_floor` bounds the peak from below with a fraction of the work. It takes
the end of the *last* micro-batch's forward, a moment of every step, and adds what that
moment holds, each part a lower bound:

- **one micro-batch's activations, run**: :func:`tpplan.analysis.memory.per_rank.first_forward` runs
  the step's first micro-batch's forward as the whole trace runs it (once at 4k blocks,
  extrapolated, for a deep model), and reads the ``activations`` part at the end of that
  forward. Of the whole trace's warm-up forward, only the batch preparation runs before it
  (cp's sequence layout, kept); the rest changes nothing there (what it leaves held is
  replaced by then; FSDP2's lazy initialization makes no activations),
  every micro-batch's forward saves the same, and no data-parallel split or accumulation
  changes what a forward saves: one run serves them all;
- **the sharded state, from shapes** (:func:`state_elements`): each parameter's shard
  (FSDP2's, over ``dp_shard × cp``, an expert's over ``efsdp``; TP-local shapes, unpadded,
  rounded down) and AdamW's two moments of each trained one, in the smallest parameter
  dtype;
- **the gradients of the micro-batches before**: with accumulation under FSDP2 (gradient
  sync off until the last), every trained parameter's TP-local gradient, unsharded, in the
  reduction dtype (FSDP2 accumulates in it).

**A pipeline rank** (:mod:`tpplan.analysis.memory.stages` adds to its stages' traced peaks the
activations its schedule keeps in flight beyond the one micro-batch each trace held): with
``a_s`` a stage's activations as above, ``h_s`` its sharded state and ``g_s`` its
gradients, the rank's peak is at least ``Σ (h_s + g_s + a_s) + max_t Σ (k_s(t) − 1) a_s``
over the points ``t`` of the rank's order where each of its stages has ``k_s(t) ≥ 1``
micro-batches in flight (the schedule's extra ``max_t Σ k_s(t) A_s − Σ A_s``, with ``A_s ≥
a_s`` the traced activations, is at least that sum), and at least ``Σ h_s + in_flight(a)``
(a stage's peak holds its largest activations beside its state). Each reported rank's
bound is left in ``result.extra["memory_floor"]`` with the activation the first stage
sends: ``search``'s memory trace takes the rank with the highest bound first.

``tests/test_search.py::test_the_first_forward_bounds_the_traced_peak`` holds the bound
under the traced peak across layouts (tp, micro-batch, accumulation, every checkpointing
mode, pipeline schedules, data-parallel splits, MoE under ep, cp) and the activations at
the end of each micro-batch's forward equal.
"""

from __future__ import annotations

from typing import Callable

import torch.nn as nn

from ...models import build_model
from ...parallel.fsdp_units import plan_parameters, tp_local_shape
from ...plan.styles import EP_STYLES
from ..analyses import compute_dtypes, model_blocks
from ..dryrun import DryRun
from .per_rank import first_forward
from .step import ModelBuilder
from ..cost.schedule import Action, last_backward, rank_in_flight, schedule_actions
from .stages import kept_split, reported_ranks, stage_traces

__all__ = ["memory_floor", "state_elements", "in_flight_beyond_one", "smallest_element"]


def smallest_element(model: nn.Module) -> int:
    """Bytes of the smallest parameter dtype of ``model`` (0 without parameters)."""
    return min((p.element_size() for p in model.parameters()), default=0)


def state_elements(result: DryRun, paths: tuple[str, ...] | None = None,
                   params: list[tuple[str, tuple, bool]] | None = None) -> tuple[int, int, int]:
    """``(sharded, sharded trained, unsharded trained)``: elements per rank of the
    parameters' shards (FSDP2's over ``dp_shard × cp``, an expert's over ``efsdp``; none
    without FSDP), of the trained ones' shards (what AdamW keeps two moments of), and of
    the trained ones unsharded (the gradients FSDP2 keeps between micro-batches with
    gradient sync off). Each parameter at its TP-local shape (an expert at ``num_experts /
    ep`` of its experts), unpadded and rounded down: lower bounds. ``paths``: only the
    parameters under these module paths (a pipeline stage's); ``params``: the model's
    :func:`plan_parameters` under the plan, where the caller has them already."""
    res, spec = result.resolved, result.plan.spec
    dims = res.dims
    modules = dict(result.model.named_modules())
    experts = {f"{p}.{n}" for p, r in res.rule_of.items() if r.style.name in EP_STYLES
               and dims.ep > 1 for n, _ in modules[p].named_parameters(recurse=False)}
    fsdp = spec.fsdp is not None
    prefixes = paths and tuple(p + "." for p in paths)
    sharded = trained = unsharded = 0
    for name, shape, trains in params or plan_parameters(result.model, spec):
        if prefixes is not None and not name.startswith(prefixes):
            continue
        path = name.rpartition(".")[0]
        expert = name in experts
        local = (shape[0] // dims.ep, *shape[1:]) if expert else \
            tp_local_shape(name, shape, modules.get(path), res, dims.tp)
        n = 1
        for d in local:
            n *= d
        shard = n // ((dims.efsdp if expert else dims.dp_shard * dims.cp) if fsdp else 1)
        sharded += shard
        trained += shard * trains
        unsharded += n * trains
    return sharded, trained, unsharded


def in_flight_beyond_one(actions: list[Action], weight: dict[int, int]) -> int | None:
    """``max Σ_stage (in_flight(stage) − 1) × weight[stage]`` over the points of one rank's
    order where every stage of ``weight`` has a micro-batch in flight; None if there is none."""
    ends = last_backward(actions)
    live = {s: 0 for s in weight}
    best = None
    for a in actions:
        if a.kind == "F":
            live[a.stage] += 1
            if all(live.values()):
                here = sum((live[s] - 1) * weight[s] for s in weight)
                best = here if best is None else max(best, here)
        elif a.kind in ends:
            live[a.stage] -= 1
    return best


def memory_floor(result: DryRun, probe: Callable = first_forward,
                 cache: dict | None = None, stages: tuple | None = None,
                 over: Callable[[int], bool] | None = None) -> int:
    """A lower bound (bytes) of ``memory_per_rank``'s ``peak`` for ``result`` (checked, its
    ``mesh`` set, the fake process group up). ``probe``: :func:`first_forward` or a function
    with its signature that answers the same (``search``'s cache: the activations it reads
    are the same for every data-parallel split and accumulation); ``cache``: a dict kept
    across the variants of one plan for :func:`state_elements` (keyed by the degrees it
    reads; the parameters and the smallest dtype once) and, under a pipeline, for the
    stage split (by what it reads of the pipeline and pp: one model), and the split with
    each stage's activations, kept under ``stages`` when given (a key the
    caller makes of everything ``probe`` and the split read: ``search`` leaves out the
    schedule's number of micro-batches). ``over``: true of a bound too large (``search``'s
    device): pp rank 0's stages are probed first, and once a rank whose stages are all
    probed has such a bound, no further stage is (that rank's bound is a bound of the
    peak; the ranks left out are missing from ``pp_ranks``)."""
    spec, shape = result.plan.spec, result.step
    dims = result.resolved.dims
    accumulates = spec.fsdp is not None and shape.grad_accum > 1
    reduce = compute_dtypes(result)[1].itemsize  # FSDP2 accumulates in the reduction dtype
    build = ModelBuilder(lambda: build_model(spec.model, "meta"))  # copied cut, where cut

    cache = {} if cache is None else cache
    # What the model and the plan's lora and freeze give, the same for every variant of a
    # plan: the smallest parameter dtype, and the parameters with whether each trains.
    if "model" not in cache:
        cache["model"] = smallest_element(result.model), plan_parameters(result.model, spec)
    size, params = cache["model"]

    def held(paths: tuple[str, ...] | None = None) -> tuple[int, int]:
        """(sharded state, + the unsharded gradients of the micro-batches before)."""
        key = (dims.tp, dims.ep, dims.dp_shard, dims.cp, paths)
        if key not in cache:
            cache[key] = state_elements(result, paths, params)
        sharded, trained, unsharded = cache[key]
        state = (sharded + 2 * trained) * size  # the shards and AdamW's two moments
        return state, state + unsharded * reduce * accumulates

    if spec.pipeline is None:
        blocks, n_blocks = model_blocks(result)
        return probe(spec, result.mesh, build, shape, n_blocks, blocks) + held()[1]
    pipe = spec.pipeline
    actions = schedule_actions(pipe.schedule, dims.pp, pipe.stages_per_rank, pipe.microbatches)

    def bounds(split, per_stage: dict[int, int]) -> dict[int, int]:
        """Each reported rank's bound, of the ranks whose stages are all probed."""
        out = {}
        for rank in reported_ranks(dims.pp):
            mine = split.of_rank(rank)
            if any(s.index not in per_stage for s in mine):
                continue
            acts = {s.index: per_stage[s.index] for s in mine}
            state = {s.index: held(s.modules) for s in mine}
            bound = sum(h[0] for h in state.values()) + rank_in_flight(actions[rank], acts)
            beyond = in_flight_beyond_one(actions[rank], acts)
            if beyond is not None:
                bound = max(bound, beyond + sum(acts[i] + state[i][1] for i in acts))
            out[rank] = bound
        return out

    if stages is not None and stages in cache:
        split, per_stage, boundary = cache[stages]
    else:
        # The stages read in place from ``result``'s model (never applied; each copied by
        # the probe only where it runs), not from one built for the split.
        enough = over and (lambda split, per_stage: any(
            over(b) for b in bounds(split, per_stage).values()))
        split, per_stage, boundary = stage_traces(
            spec, result.mesh, lambda: result.model, shape, dims, probe, enough,
            over and (0, None), kept_split(cache, result.model, spec, dims.pp))
    ranks = bounds(split, per_stage)
    if stages is not None and stages not in cache and len(ranks) == len(reported_ranks(dims.pp)):
        cache[stages] = split, per_stage, boundary  # only whole: a later call may need all
    out = max(ranks.values())
    # Which rank's stages a trace of the whole step takes first (analyze_memory's ``over``).
    result.extra["memory_floor"] = dict(peak=out, pp_ranks=ranks, boundary=boundary)
    return out
