"""A pipeline schedule as data: which forward and backward each pp rank runs, in order, and
what follows from that order -- the micro-batches each stage keeps in flight and the bubble.

The orders are torch's own (``torch.distributed.pipelining.schedules``): the multi-stage
schedules run the table their ``_calculate_single_rank_operations`` builds, which needs only
the degrees, so it is called on an instance that holds nothing but them (no stage, no
process group). GPipe and 1F1B run a loop rather than their table (and 1F1B's table is off
by one on the last rank in torch 2.13), so their orders are the loops': GPipe every forward
then every backward; 1F1B ``min(m, stages - s)`` forwards, then one backward and one
forward until the forwards run out, then the backwards. Formulas and sources:
docs/dry-run.md, "Pipeline stages".
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from ..._torch.pipelining import computation_types, schedule_table
from ...plan.pipeline import SCHEDULES

__all__ = ["Action", "schedule_actions", "torch_table", "in_flight", "rank_in_flight",
           "bubble_fraction", "TIME", "fsdp_order", "fsdp_gathers", "schedule_facts"]


class Action(NamedTuple):
    """One computation: ``F`` forward, ``B`` full backward, ``I`` backward for the input
    only, ``W`` backward for the weights only (zero-bubble schedules), of micro-batch
    ``mb`` on stage ``stage`` (a tuple: schedules of thousands are simulated per search)."""

    kind: str
    stage: int
    mb: int


# Unit times of the bubble simulation: a backward costs two forwards (one for the input's
# gradient, one for the weights'), as in Narayanan et al. 2021 and Qi et al. 2023.
TIME = {"F": 1, "B": 2, "I": 1, "W": 1}


@functools.lru_cache(maxsize=256)
def torch_table(name: str, pp: int, v: int, m: int) -> dict[int, list]:
    """torch's table of each rank's actions (cached: :func:`schedule_actions` and
    :func:`fsdp_order` both lower it; neither changes it)."""
    if not _KINDS:
        _KINDS.update({t: t.value for t in computation_types() if t.value in TIME})
    return schedule_table(SCHEDULES[name].torch_class, pp, v, m, SCHEDULES[name].v_shape)


_KINDS: dict = {}  # torch's computation types that are computations, as their letters


def _computations(action) -> list[Action]:
    """torch's action as computations; an overlapped forward+backward (DualPipeV) as both,
    forward first (both are in flight while it runs)."""
    if action is None:
        return []
    subs = getattr(action, "sub_actions", None)
    if subs:
        return [c for a in subs for c in _computations(a)]
    kind = _KINDS.get(action.computation_type)
    if kind is None:
        return []  # communication, resharding, gradient reduction
    return [Action(kind, action.stage_index, action.microbatch_index)]


@functools.lru_cache(maxsize=256)
def schedule_actions(name: str, pp: int, stages_per_rank: int, m: int) -> dict[int, list[Action]]:
    """Each pp rank's computations, in the order schedule ``name`` runs them (cached: a
    function of its arguments only, and ``search`` asks for the same ones many times; the
    caller must not change what it gets)."""
    if not SCHEDULES[name].multi:
        out = {}
        for s in range(pp):
            if name == "gpipe":
                order = [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
            else:  # 1f1b: Schedule1F1B._step_microbatches
                warm = min(m, pp - s)
                order = [("F", i) for i in range(warm)]
                for i in range(m):
                    order.append(("B", i))
                    if warm + i < m:
                        order.append(("F", warm + i))
            out[s] = [Action(k, s, i) for k, i in order]
        return out
    table = torch_table(name, pp, stages_per_rank, m)
    return {r: [c for a in acts for c in _computations(a)] for r, acts in table.items()}


@functools.lru_cache(maxsize=256)
def fsdp_order(name: str, pp: int, stages_per_rank: int, m: int) -> dict[int, list[Action]]:
    """Each pp rank's order as FSDP2 sees it: the computations, and for the multi-stage
    schedules the ``UNSHARD``/``RESHARD`` of a whole stage that torch's runtime inserts
    (``_PipelineScheduleRuntime._prepare_schedule_with_comms`` lowers its table with
    ``_add_unshard_reshard``; kinds ``U`` and ``R`` here). GPipe and 1F1B insert none."""
    if not SCHEDULES[name].multi:
        return schedule_actions(name, pp, stages_per_rank, m)
    return {rank: _unshard_reshard(acts) for rank, acts in
            torch_table(name, pp, stages_per_rank, m).items()}


def _stages_of(action) -> list[int]:
    """The stages an action computes on, as torch's lowering reads them: an overlapped
    forward+backward's sub-actions' (in order, once each), else its own."""
    if action.sub_actions is not None and action.computation_type.value == "OVERLAP_F_B":
        return list(dict.fromkeys(a.stage_index for a in action.sub_actions))
    return [action.stage_index]


def _unshard_reshard(actions: list, active_most: int = 3) -> list[Action]:
    """One rank's computations with the ``U`` and ``R`` that torch's
    ``_add_unshard_reshard`` inserts (``max_active_stages`` 3): before each action, the stages
    no longer among the next ``active_most`` distinct stages to compute are resharded, then
    those among them not yet unsharded are unsharded, in that order; what is left is
    resharded at the end. The same sets, in the same order, as torch's, which rescans the
    rest of the order at every action (quadratic: most of a search's pipeline
    communication analysis at 2 stages per rank); here each action's next stages come from
    the one after it. ``tests/test_schedule.py`` holds the two equal."""
    acts = [a for a in actions if a is not None]
    # Each action's next stages to compute, first seen first: torch stops at the end of the
    # action that brings their count to ``active_most`` (an overlapped pair may bring two).
    nexts: list[list[int]] = [[]] * len(acts)
    upcoming: list[tuple[int, int]] = []  # (stage, the action that brings it first)
    for i in range(len(acts) - 1, -1, -1):
        mine = _stages_of(acts[i])
        upcoming = [(s, i) for s in mine] + [e for e in upcoming if e[0] not in mine]
        nxt = []
        for k, (stage, by) in enumerate(upcoming):
            nxt.append(stage)
            if len(nxt) >= active_most and (k + 1 == len(upcoming) or upcoming[k + 1][1] != by):
                break
        nexts[i] = nxt
    active: set[int] = set()
    out: list[Action] = []
    for action, nxt in zip(acts, nexts):
        for stage in [s for s in active if s not in nxt]:
            active.remove(stage)
            out.append(Action("R", stage, -1))
        for stage in [s for s in nxt if s not in active]:
            active.add(stage)
            out.append(Action("U", stage, -1))
        out += _computations(action)
    for stage in list(active):
        active.remove(stage)
        out.append(Action("R", stage, -1))
    return out


def fsdp_gathers(order: list[Action], stage: int, reshard_after_forward: bool) -> int:
    """How often FSDP2 all-gathers one unit of ``stage`` in a step run in ``order``.

    Inside a schedule, ``PipelineStage.backward_maybe_with_nosync`` turns gradient sync and
    resharding after backward off for every micro-batch, and ``perform_reduce_grad`` turns
    both back on once, after the stage's last backward (one reduce-scatter per unit, then
    every unit resharded). Resharding after forward stays as the plan sets it (never for the
    root: FSDP2 keeps the root unsharded after forward). So a unit is gathered when a
    forward, backward or ``UNSHARD`` finds it sharded: at the step's start, after a forward
    that resharded it, after a ``RESHARD``. In 1F1B that is ``m + 1`` times with resharding
    after forward (every forward but those right after a backward, and the first backward
    after a forward), once without."""
    sharded, n = True, 0
    for a in order:
        if a.stage != stage:
            continue
        if a.kind == "R":
            sharded = True
            continue
        if sharded:
            n += 1
            sharded = False
        if a.kind == "F" and reshard_after_forward:
            sharded = True
    return n


def last_backward(actions: list[Action]) -> set[str]:
    """``W`` where the schedule splits backward (the weights' gradient still needs the
    saved activations after the input's), else ``B``."""
    return {"W"} if any(a.kind == "W" for a in actions) else {"B"}


def in_flight(actions: dict[int, list[Action]]) -> dict[int, int]:
    """Per stage: the most micro-batches whose forward has run and whose backward has not
    finished (their activations are still saved), at any point of the step."""
    out: dict[int, int] = {}
    for acts in actions.values():
        ends = last_backward(acts)
        live: dict[int, int] = {}
        for a in acts:
            if a.kind == "F":
                live[a.stage] = live.get(a.stage, 0) + 1
                out[a.stage] = max(out.get(a.stage, 0), live[a.stage])
            elif a.kind in ends:
                live[a.stage] -= 1
    return out


def rank_in_flight(actions: list[Action], weight: dict[int, int]) -> int:
    """One rank's most ``Σ_stage in_flight(stage) × weight[stage]`` at any point: the saved
    activations of every micro-batch in flight on all its stages at once."""
    ends = last_backward(actions)
    live = best = 0
    for a in actions:
        if a.kind == "F":
            live += weight[a.stage]
            best = max(best, live)
        elif a.kind in ends:
            live -= weight[a.stage]
    return best


def bubble_fraction(actions: dict[int, list[Action]], m: int) -> float:
    """Idle time over compute time, per rank, of the schedule run with unit times
    (:data:`TIME`) and no communication cost: each rank runs its computations in order, a
    forward once the previous stage's forward of that micro-batch is done, a backward once
    the next stage's backward (input part) and its own forward are done, a ``W`` after its
    ``I``. GPipe and 1F1B give ``(p-1)/m``, interleaved 1F1B ``(p-1)/(v·m)``."""
    done: dict[tuple[str, int, int], int] = {}
    clock = {r: 0 for r in actions}
    pos = {r: 0 for r in actions}
    last = max(a.stage for acts in actions.values() for a in acts)

    remaining = sum(len(v) for v in actions.values())
    while remaining:
        progressed = False
        for r, acts in actions.items():
            i, t = pos[r], clock[r]
            while i < len(acts):
                kind, stage, mb = acts[i]
                if kind == "F":  # after the previous stage's forward
                    ready = done.get(("F", stage - 1, mb), None) if stage else 0
                elif kind == "W":  # after its input's gradient
                    ready = done.get(("I", stage, mb))
                else:  # after its forward and the next stage's input gradient
                    ready = done.get(("F", stage, mb))
                    if ready is not None and stage != last:
                        grad = done.get(("G", stage + 1, mb))
                        ready = None if grad is None else max(ready, grad)
                if ready is None:
                    break
                t = max(t, ready) + TIME[kind]
                done[(kind, stage, mb)] = t
                if kind in ("B", "I"):  # the input's gradient, sent to the stage before
                    done[("G", stage, mb)] = t
                i += 1
            if i != pos[r]:
                progressed = True
                remaining -= i - pos[r]
                pos[r], clock[r] = i, t
        if not progressed:
            raise ValueError("the schedule's order deadlocks")
    work = max(sum(TIME[a.kind] for a in acts) for acts in actions.values())
    return (max(clock.values()) - work) / work


@functools.lru_cache(maxsize=1024)
def schedule_facts(name: str, pp: int, stages_per_rank: int, m: int) -> tuple[float, dict[int, int]]:
    """``(bubble_fraction, in_flight)`` of the schedule, once per set of degrees (the caller
    must not change the dict)."""
    actions = schedule_actions(name, pp, stages_per_rank, m)
    return bubble_fraction(actions, m), in_flight(actions)
