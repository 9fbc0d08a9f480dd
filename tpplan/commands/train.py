"""``tpplan train``: train the plan's model on this machine's ranks (or torchrun's).

    torchrun --standalone --nproc-per-node 4 -m tpplan train --plan plans/llama.yaml
    tpplan train --plan plans/llama.yaml --nproc 4     # the same, launched for you
    tpplan train --plan plans/llama.yaml               # one process
    tpplan train --plan plans/llama.yaml --nproc 4 --max-restarts 2   # restart on a failure

Exit codes: 0 done; 1 an error (one line says which); 75 stopped by SIGTERM/SIGINT after
saving a checkpoint (run it again with --resume).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable

from ._common import add_plan_args

SHUTDOWN_S = 300  # how long torchrun waits for workers to save after a signal
RANK0_FIRST_S = 5  # how long the other ranks wait to exit after an error rank 0 says
EXIT_STOPPED = 75  # tpplan.train.signals.EXIT_STOPPED (not imported: it would load torch)
# What each worker that ``--nproc`` starts runs after the interpreter: this package's command.
# A script that wraps the command (tests/hooked.py) puts its own path here, so the workers
# torchrun starts run it too.
WORKER_COMMAND = ["-m", "tpplan"]
# What each worker calls where workers are forked (:func:`run_worker`); a wrapping script puts
# a picklable callable of its own here, as for WORKER_COMMAND.
WORKER_ENTRY = None
_forked = False  # this process is a forked worker: the agent waits for run_worker to return
# Imported once by the server the workers are forked from (the rest, lazily, by each).
PRELOAD = ("torch", "torch.distributed.tensor", "torch.distributed.fsdp",
           "torch.distributed.checkpoint", "tpplan.commands.train", "tpplan.train",
           "tpplan.analysis.runs.expected")


def register(sub) -> None:
    p = sub.add_parser("train", help="train the plan's model (TP + FSDP2, DCP checkpoints)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_plan_args(p)
    p.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="launch N local processes through torch.distributed.run (torchrun)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="with --nproc: restart all workers up to N times after a failure; "
                        "each restart resumes from the last intact checkpoint")
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="PATH",
                   help="continue from the latest complete checkpoint of the run folder, or "
                        "from PATH (a step-N checkpoint or a folder holding them)")
    p.add_argument("--overwrite", action="store_true",
                   help="start over in a run folder that already holds checkpoints")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="override the automatic choice (cuda + nccl where GPUs are present)")
    p.add_argument("--profile", metavar="START:END", default=None,
                   help="torch.profiler traces of steps START to END (both included) per rank "
                        "in <run_dir>/profile/, and a table of compute against each mesh "
                        "dimension's collectives (the plan key metrics.profile)")
    p.set_defaults(run=run)


def _relaunch(args: argparse.Namespace) -> int:
    """Re-run this command under torchrun with ``--nproc`` local workers."""
    import uuid

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    from .._torch.launch import run_forked, shutdown_timeout_args
    from ..train.setup import check_before_launch

    # The plan's mistakes (lora, freeze, rules, initializers) said once, before any worker.
    check_before_launch(args.plan, args.overrides, args.nproc)

    # --standalone, with a launch id we know, so a stop by a signal can be told from a crash.
    launch = f"tpplan-{uuid.uuid4().hex[:12]}"
    argv = ["--nnodes=1", "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0",
            f"--rdzv-id={launch}", f"--nproc-per-node={args.nproc}",
            f"--max-restarts={args.max_restarts}", *shutdown_timeout_args(SHUTDOWN_S),
            *WORKER_COMMAND]
    worker = ["train", "--plan", args.plan]
    for o in args.overrides:
        worker += ["--set", o]
    if args.resume is not None:
        worker += ["--resume", args.resume]
    if args.overwrite:
        worker.append("--overwrite")
    if args.device:
        worker += ["--device", args.device]
    if args.profile:
        worker += ["--profile", args.profile]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")  # as torchrun's ``python -u``
    # A HF model's launch check imported transformers here: its workers will too.
    preload = [*PRELOAD, *(["transformers", "tpplan.models.hf"] if "transformers" in sys.modules else [])]
    try:
        main = getattr(args, "main", None)  # set by the command line; else no fork
        if main is None or not run_forked(argv + worker, WORKER_ENTRY or run_worker, (main, worker),
                                          preload, from_here=_workers_on_cpu(args.device)):
            torchrun(argv + worker)
    except ChildFailedError:  # the failing rank already printed why, as "error: ..."
        print(f"tpplan train: the run on {args.nproc} processes did not finish (the reason is "
              f"above)", file=sys.stderr)
        return 1
    except SignalException as e:  # the workers had SHUTDOWN_S to finish a step and save
        return EXIT_STOPPED if _stopped_cleanly(args, launch) else 128 + int(e.sigval)
    return 0


def _workers_on_cpu(device: str | None) -> bool:
    """Will the workers run on the CPU, known without asking CUDA (which would make this
    process unfit to fork a CUDA worker from): ``--device cpu``, ``TPPLAN_DEVICE=cpu``, or a
    torch built without CUDA and ROCm."""
    import torch

    chosen = device or os.environ.get("TPPLAN_DEVICE")
    if chosen:
        return chosen == "cpu"
    return torch.version.cuda is None and torch.version.hip is None


def run_worker(main: Callable[[list[str]], int], argv: list[str]) -> None:
    """One worker of ``--nproc``, forked by torchrun's agent: ``main`` (the command line's)
    on ``argv``. It returns (the agent waits for every worker's return) or exits with the
    command's code; the fork's end skips the interpreter teardown ``run`` otherwise avoids."""
    global _forked
    _forked = True
    code = main(argv)
    if code:
        sys.exit(code)


def _stopped_cleanly(args: argparse.Namespace, launch: str) -> bool:
    """Did this launch's rank 0 record a stop with a checkpoint (not a kill mid-save)?"""
    from ..api import load
    from ..train.runfolder import read_launch
    from ..train.setup import run_folders

    run_dir, _ = run_folders(load(args.plan, args.overrides), args.plan)
    record = read_launch(run_dir)
    return record.get("launch") == launch and "stopped" in record


def run(args: argparse.Namespace) -> int:
    if args.max_restarts and args.nproc is None:
        print("error: --max-restarts needs --nproc (under your own torchrun, pass "
              "--max-restarts to torchrun)", file=sys.stderr)
        return 2
    if args.nproc is not None:
        if args.nproc < 1:
            print("error: --nproc must be at least 1", file=sys.stderr)
            return 2
        if "RANK" in os.environ:
            print("error: --nproc is for launching; under torchrun leave it out", file=sys.stderr)
            return 2
        from .replicas import fault_tolerant, launch_replicas

        if fault_tolerant(args.plan, args.overrides):  # one torchrun per replica group
            return launch_replicas(args, WORKER_COMMAND)
        return _relaunch(args)
    from ..analysis.runs.expected import estimate
    from ..train import TrainError, train

    rank0 = os.environ.get("RANK", "0") == "0"
    from .replicas import worker_overrides

    overrides = worker_overrides(args.plan, list(args.overrides))  # a replica group's job
    if args.profile:  # quoted: YAML would read 3:4 unquoted as text anyway, this says so
        overrides.append(f'metrics.profile="{args.profile}"')
    try:
        summary = train(args.plan, overrides, args.resume, args.overwrite, args.device,
                        estimate=lambda world, device: estimate(args.plan, overrides, world,
                                                                 device))
    except TrainError as e:
        # Raised on every rank alike (before the process group, or agreed on after it):
        # say it once, fail everywhere.
        if rank0 or e.every_rank:
            print(f"error: {e}", file=sys.stderr)
        elif "TORCHELASTIC_RUN_ID" in os.environ:
            # The first worker to exit has torchrun stop the others: rank 0, the one that says
            # it, must get there first (workers forked together reach a data error together).
            time.sleep(RANK0_FIRST_S)
        return 1
    code = EXIT_STOPPED if summary.get("stopped") else 0
    if ("TORCHELASTIC_RUN_ID" in os.environ and not _forked) or getattr(args, "command_line", False):
        # The run is complete and its process group destroyed. Gloo's worker threads can
        # still abort the interpreter's teardown ("terminate called without an active
        # exception", pytorch/pytorch#190489), which torchrun would report as a failed
        # run, and a shell as exit -6 after a one-process run printed its summary; a
        # process that has finished the run skips that teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
