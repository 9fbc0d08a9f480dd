"""The training loop's few seams for fault tolerance (:mod:`tpplan.ft`), off without the
section: which steps run, which share of the global batch this rank takes, what a step of
fewer replica groups trained, and the metrics row's replica fields."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["catch_up", "checkpoint_writer", "group_targets", "hook_rank", "join_replicas", "lost_rank_hint",
           "replica_fields", "share", "step_numbers"]


def join_replicas(prep, trainee, device_type: str, reporter, start: int) -> Any:
    """This rank's :class:`tpplan.ft.Replica` when it runs in a replica group, else None
    (also when the checkpoint it starts from is the run's last step: nothing to agree on)."""
    from ..ft.groups import group_checkpoints, group_index

    group = group_index()
    if prep.plan.spec.fault_tolerance is None or group is None or start >= prep.plan.train.steps:
        return None
    from ..ft.replica import Replica

    replica = Replica(prep.plan.spec.fault_tolerance, group, trainee, device_type, reporter.note)
    replica.start_at(start)
    replica.checkpoints = prep.ckpt_dir if prep.plan.checkpoint.enabled else group_checkpoints()
    if not prep.overwrite:  # --overwrite's first round: the checkpoints there are an earlier run's
        passed_over: set = set()  # checkpoints found damaged: not hashed again at each quorum
        replica.catch_up = lambda step: catch_up(prep, trainee, reporter, group, step, passed_over)
    # which process is which rank of the group: `kill -9 $(cat <run_dir>/replica-1/rank1.pid)`
    (prep.run_dir / f"rank{dist.get_rank()}.pid").write_text(f"{os.getpid()}\n")
    return replica


def step_numbers(start: int, steps: int, replica) -> Iterator[int]:
    """The steps after ``start``; in a replica group, the quorum's next step each time (the
    same one again when it did not commit, a later one after a recovery from a peer or from
    the run's newest checkpoint)."""
    if replica is None:
        yield from range(start + 1, steps + 1)
        return
    while replica.manager.current_step() < steps:  # committed steps, a peer's after a recovery
        step = replica.next_step()
        if step is not None:  # None: this group took a newer checkpoint; a quorum again
            yield step


def _sound(path) -> bool:
    """Rank 0: whether a complete checkpoint reads (sizes, DCP metadata, trainer state)."""
    from .. import checkpoint as ckpt

    try:
        ckpt.check_structure(path)
    except ckpt.Damaged:
        return False
    return True


def catch_up(prep, trainee, reporter, group: int, step: int, passed_over: set) -> int | None:
    """Collective over the group's ranks, at a quorum without every group, before this group
    trains ``step``. A group that left (finished the run, or died) may have gone past it: its
    checkpoints, in the run's folder, are then the run's latest state, which no live group
    holds. Returns the step of the newest intact checkpoint at or past ``step`` (this group
    now stands there: the checkpoint loaded, or nothing to load when it is the run's last
    step), None when there is none (this group is not behind the run). A checkpoint found
    damaged is said once and added to ``passed_over``."""
    from .. import checkpoint as ckpt
    from ..ft.groups import run_checkpoints
    from .trainee import load_checkpoint

    box: list[Any] = [None]
    if dist.get_rank() == 0:
        box = [[p for p in ckpt.complete_checkpoints(run_checkpoints(prep.plan, prep.run_dir, group))
                if ckpt.step_of(p) >= step and p not in passed_over and _sound(p)]]
    dist.broadcast_object_list(box, src=0)
    for found in box[0]:  # newest first
        at = ckpt.step_of(found)
        if at >= prep.plan.train.steps:
            reporter.note(f"replica group {group}: the run finished at step {at} while this group was "
                          f"down (checkpoint {found}); nothing left to train")
            return at
        if prep.plan.checkpoint.verify and (problems := ckpt.check_contents(found)):
            reporter.note(f"replica group {group}: checkpoint {found.name} is damaged, not used: {problems[0]}")
            passed_over.add(found)
            continue
        load_checkpoint(prep, trainee, found)
        reporter.rewind(at)
        reporter.note(f"replica group {group}: the run went on to step {at} without this group, and no "
                      f"group alive holds it; took checkpoint {found} and goes on from step {at + 1}")
        return at
    return None


def checkpoint_writer(prep, replica) -> Any:
    """What ``save_checkpoint`` takes when this rank writes the step's checkpoint, else None.
    In a replica group: the lowest-numbered group of the step writes the run's checkpoints
    (group 0's folder), so none is skipped while group 0 is down and none is written twice."""
    if replica is None:
        return prep if prep.plan.checkpoint.enabled else None
    if replica.checkpoints is None or not replica.saves():
        return None
    return prep if replica.checkpoints == prep.ckpt_dir else dataclasses.replace(prep, ckpt_dir=replica.checkpoints)


def share(prep, dp_rank: int, replica) -> tuple[int, int, int]:
    """(global batch, data-parallel rank, degree) of this rank's slice of a step's batch."""
    if replica is None:
        return prep.step.global_batch, dp_rank, prep.dims.dp
    rank, dp = replica.data_place(dp_rank, prep.dims.dp)
    return prep.step.global_batch * replica.spec.replica_groups, rank, dp


def group_targets(prep, batch, device) -> int:
    """The loss targets this replica group's share of the step's batch holds: each rank's
    added over the group (the ranks of one data-parallel slice hold the same batch)."""
    mine = batch.tokens[:, 1:].numel() if batch.mask is None else int(batch.mask.sum())
    total = torch.tensor([float(mine)], device=device)
    dist.all_reduce(total)
    return int(round(total.item() * prep.dims.dp / dist.get_world_size()))


def replica_fields(replica, step: int, trained: int, last: bool) -> dict:
    """The metrics row's replica groups taking part, targets trained, seconds spent agreeing
    on them (a failed try of the step, a recovery, included), and the step's event;
    on an event and the last step, this rank's weights digest (equal across the groups)."""
    if replica is None:
        return {}
    row = {"replicas": replica.participants, "tokens_trained": trained, "quorum_s": replica.waited}
    replica.waited = 0.0
    if (event := replica.event(step)) is not None:
        row["event"] = event
    if event is not None or last:
        row["weights_sha256"] = replica.digest()
    return row


def hook_rank(rank: int, world: int, replica) -> int:
    """This rank's number over every replica group (what the test seams are told)."""
    return rank if replica is None else replica.group * world + rank


def lost_rank_hint() -> str:
    """What happens next when a rank of this job was lost: torchrun's restart resumes the
    last checkpoint, or, in a replica group, takes the weights from a live group."""
    from ..ft.groups import group_index

    group = group_index()
    if group is None:
        return "under torchrun --max-restarts the workers restart and resume from the last checkpoint"
    return (f"replica group {group} stops here; the other groups go on, and restarted by its "
            f"torchrun (--max-restarts) it takes the weights from a live group and rejoins")
