"""Where a replica group stands in a fault-tolerant run, without torch or torchft.

A replica group is an ordinary tpplan job: the plan with ``mesh.dp_replicate=1``, its share
of the global batch, and (beyond group 0) a run folder of its own without checkpoints. The
launcher passes these as ``--set`` overrides and the group's index in the environment, so
the trainer reads the same plan and the same flags as a run without fault tolerance.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..plan import ErrorList
from ..plan.fault_tolerance import FT_EXTRA

__all__ = ["ENV_CHECKPOINTS", "ENV_GROUP", "ENV_LIGHTHOUSE", "ENV_START", "group_checkpoints", "group_index",
           "group_overrides", "group_run_dir", "missing_extra", "run_checkpoints"]

ENV_GROUP = "TPPLAN_REPLICA_GROUP"  # this process's replica group, 0 .. replica_groups-1
ENV_LIGHTHOUSE = "TORCHFT_LIGHTHOUSE"  # torchft's own name for the lighthouse's address
# host:port of a store where the groups' first rounds meet before their first quorum, so the
# first step has every group (set by the local launcher; without it a late group recovers)
ENV_START = "TPPLAN_FT_START"
# group 0's checkpoint folder, for a group beyond 0 that writes a step's checkpoint while it is
# the lowest-numbered group of the step (set by the worker itself; unset: the run saves none)
ENV_CHECKPOINTS = "TPPLAN_FT_CHECKPOINTS"


def missing_extra() -> str | None:
    """One line when torchft is not installed (a plan with ``fault_tolerance`` needs it)."""
    try:
        import torchft  # noqa: F401 - its presence is the question
    except ImportError:
        return (f"the plan's fault_tolerance section needs torchft: pip install '{FT_EXTRA}' "
                f"(torchft 0.2.0 and its lighthouse)")
    return None


def group_index() -> int | None:
    """This process's replica group (set by the launcher or the user), None outside one."""
    value = os.environ.get(ENV_GROUP)
    return int(value) if value not in (None, "") else None


def group_checkpoints() -> Path | None:
    """The run's checkpoint folder as a group beyond 0 writes it (:data:`ENV_CHECKPOINTS`)."""
    value = os.environ.get(ENV_CHECKPOINTS)
    return Path(value) if value else None


def group_run_dir(run_dir: Path, group: int) -> Path:
    """Group 0 writes the run folder (metrics, checkpoints); group g its own ``replica-g``
    inside it (metrics only), which ``--overwrite`` of the run leaves alone (a folder already
    named so, as the launcher passes it, is the group's own)."""
    return run_dir if group == 0 or run_dir.name == f"replica-{group}" else run_dir / f"replica-{group}"


def run_checkpoints(plan, run_dir: Path, group: int) -> Path:
    """The run's checkpoint folder (group 0's) as group ``group`` finds it from its own run
    folder (``run_dir``: the run's, or its ``replica-g`` inside)."""
    if plan.spec.checkpoint.dir:
        return Path(plan.spec.checkpoint.dir)
    return (run_dir.parent if group and run_dir.name == f"replica-{group}" else run_dir) / "checkpoints"


def group_overrides(plan, group: int, run_dir: Path) -> list[str]:
    """``--set`` overrides that make ``plan`` (a :class:`tpplan.Plan` with the section) the
    job of replica group ``group``: one replica of the mesh, its share of the global batch.
    A group beyond 0 neither resumes from nor clears the run's checkpoints (it takes the
    weights from a live group); it writes one only as the lowest group of a step."""
    ft, t = plan.spec.fault_tolerance, plan.spec.train
    out = ["mesh.dp_replicate=1"]
    if t.local_batch_size is None and t.global_batch_size is not None:
        if t.global_batch_size % ft.replica_groups:
            errs = ErrorList()
            errs.add(f"train.global_batch_size={t.global_batch_size} is not divisible by "
                     f"fault_tolerance.replica_groups={ft.replica_groups}: each replica group "
                     f"trains the same share", t.locs.get("global_batch_size", t.loc))
            errs.raise_if_any()
        out.append(f"train.global_batch_size={t.global_batch_size // ft.replica_groups}")
    if group:
        out += [f"metrics.run_dir={group_run_dir(run_dir, group)}", "checkpoint.enabled=false"]
    return out
