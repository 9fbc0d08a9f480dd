"""``tpplan train`` of a plan with ``fault_tolerance``: the lighthouse and one torchrun per
replica group on this machine (the launcher), and each group's own overrides (the workers).

    tpplan train --plan p.yaml --nproc 2 --max-restarts 3   # replica_groups × 2 ranks

``--nproc`` is the ranks of one replica group; ``--max-restarts`` restarts a group that lost a
rank (it then takes the weights from a live group and rejoins); the other groups go on.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

__all__ = ["fault_tolerant", "launch_replicas", "worker_overrides"]


def fault_tolerant(plan_path: str, overrides: list[str]) -> bool:
    from ..api import load

    return load(plan_path, overrides).spec.fault_tolerance is not None


def worker_overrides(plan_path: str, overrides: list[str]) -> list[str]:
    """A replica group's worker: the plan made that group's job (one replica, its share of
    the batch, its run folder); the overrides unchanged outside a replica group. A plan with
    the section run outside one, or without torchft installed, is one line."""
    from ..api import load
    from ..ft.groups import ENV_CHECKPOINTS, group_index, group_overrides, missing_extra, run_checkpoints
    from ..plan.errors import CommandError
    from ..train.setup import run_folders

    plan = load(plan_path, overrides)
    if plan.spec.fault_tolerance is None:
        return overrides
    if problem := missing_extra():
        raise CommandError(problem)
    group = group_index()
    if group is None:
        raise CommandError("the plan has a fault_tolerance section: start it with tpplan train "
                           "--nproc N (N ranks per replica group), or set TPPLAN_REPLICA_GROUP and "
                           "TORCHFT_LIGHTHOUSE for each group's torchrun (docs/fault-tolerance.md)")
    if not 0 <= group < plan.spec.fault_tolerance.replica_groups:
        raise CommandError(f"TPPLAN_REPLICA_GROUP={group}: the plan has "
                           f"{plan.spec.fault_tolerance.replica_groups} replica groups (0 .. "
                           f"{plan.spec.fault_tolerance.replica_groups - 1})")
    run_dir, ckpt_dir = run_folders(plan, plan_path)
    if group and plan.checkpoint.enabled:  # where it writes a step's checkpoint as its lowest group
        os.environ[ENV_CHECKPOINTS] = str(run_checkpoints(plan, run_dir, group))
    return [*overrides, *group_overrides(plan, group, run_dir)]


def _train_args(args: argparse.Namespace, group: int, run_dir) -> list[str]:
    from ..ft.groups import group_run_dir

    argv = ["train", "--plan", args.plan]
    for o in args.overrides:
        argv += ["--set", o]
    if group:  # what the worker sets itself, on its command line too: `ps` tells the groups apart
        argv += ["--set", f"metrics.run_dir={group_run_dir(run_dir, group)}"]
    if args.resume is not None and group == 0:  # the others take the weights from group 0
        argv += ["--resume", args.resume]
    if args.overwrite:
        argv.append("--overwrite")
    if args.device:
        argv += ["--device", args.device]
    if getattr(args, "profile", None):
        argv += ["--profile", args.profile]
    return argv


def launch_replicas(args: argparse.Namespace, worker: list[str]) -> int:
    """Start the lighthouse (unless the plan names one) and each group's torchrun; wait for
    them. 0 when a group finished the run (a group that ran out of restarts is said)."""
    from ..api import load
    from ..ft.groups import group_overrides, missing_extra
    from .._torch.launch import shutdown_timeout_args
    from ..ft.launch import start_groups, start_lighthouse, torchrun_argv
    from ..train.setup import check_before_launch, run_folders

    plan = load(args.plan, args.overrides)
    ft = plan.spec.fault_tolerance
    if problem := missing_extra():
        print(f"error: {problem}", file=sys.stderr)
        return 1
    if args.nproc is None:
        print(f"error: the plan has {ft.replica_groups} replica groups: give --nproc N, the ranks "
              f"of one group (each group is its own torchrun)", file=sys.stderr)
        return 2
    run_dir, _ = run_folders(plan, args.plan)
    # The batch's split over the groups, then one group's job (as its workers will see it):
    # the plan's mistakes said once, before the lighthouse or any worker starts.
    check_before_launch(args.plan, [*args.overrides, *group_overrides(plan, 0, run_dir)], args.nproc)
    server, address = start_lighthouse(ft, run_dir / "lighthouse.log") if ft.lighthouse is None \
        else (None, ft.lighthouse)
    print(f"tpplan train: {ft.replica_groups} replica groups × {args.nproc} ranks, lighthouse "
          f"{address}, a step commits with at least {ft.min_replicas}", flush=True)
    procs, _meeting = start_groups(ft.replica_groups, address, lambda g: torchrun_argv(
        args.nproc, args.max_restarts, worker, _train_args(args, g, run_dir), shutdown_timeout_args(300)))
    # a SIGTERM to this launcher (a scheduler's stop) goes on to each group's torchrun, which
    # gives its workers the grace to finish the step and save; the lighthouse goes last
    stopped = []
    previous = signal.signal(signal.SIGTERM, lambda signum, _: stopped.append(signum) or _stop(procs, signum))
    try:
        codes = [p.wait() for p in procs]
    except KeyboardInterrupt:
        _stop(procs, signal.SIGTERM)
        codes = [p.wait() for p in procs]
    finally:
        signal.signal(signal.SIGTERM, previous)
        if server is not None:
            server.terminate()
            server.wait()
    if stopped:
        print("tpplan train: stopped by SIGTERM, passed on to each replica group's torchrun (their "
              "workers finish the step and save, as without fault tolerance)", file=sys.stderr)
        return 128 + signal.SIGTERM
    for g, code in enumerate(codes):
        if code:
            print(f"tpplan train: replica group {g} did not finish (exit {code}; the reason is "
                  f"above)", file=sys.stderr)
    return 0 if 0 in codes else 1


def _stop(procs: list, signum: int) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signum)


def dry_run_overrides(plan_path: str, overrides: list[str]) -> list[str]:
    """The dry run of a plan with the section sees the replica groups as ``dp_replicate``
    (HSDP's mesh: each rank's memory and in-group traffic are a replica group's)."""
    from ..api import load

    ft = load(plan_path, overrides).spec.fault_tolerance
    if ft is None or load(plan_path, overrides).spec.mesh.dp_replicate != 1:
        return overrides
    return [*overrides, f"mesh.dp_replicate={ft.replica_groups}"]


def replica_traffic(plan_path: str, overrides: list[str], comm: dict | None, world: int) -> dict | None:
    """What crosses between replica groups each step (torchft's all-reduce of each rank's
    gradient shards, in float32, over the slow links) and where the lighthouse is."""
    from ..api import load

    ft = load(plan_path, overrides).spec.fault_tolerance
    if ft is None:
        return None
    rows = [r for r in (comm or {}).get("collectives", []) if r["mesh_dim"] == "dp_replicate"]
    return {"replica_groups": ft.replica_groups, "ranks_per_group": world // ft.replica_groups,
            "min_replicas": ft.min_replicas, "cross_group_bytes": sum(r["bytes"] for r in rows),
            "cross_group_wire_bytes": sum(r["wire_bytes"] for r in rows), "collectives": 1 if rows else 0,
            "lighthouse": ft.lighthouse or "started by tpplan train on the launching machine"}


def render_replicas(out, ft: dict) -> None:
    from ._common import size

    out.print(f"fault tolerance: {ft['replica_groups']} replica groups × {ft['ranks_per_group']} ranks, a "
              f"step commits with {ft['min_replicas']}; across groups per step: {ft['collectives']} "
              f"all-reduce of {size(ft['cross_group_bytes'])} per rank ({size(ft['cross_group_wire_bytes'])} "
              f"on the wire) through torchft; lighthouse: {ft['lighthouse']}", highlight=False)
