"""``tpplan train``: train the plan's model on this machine's ranks (or torchrun's).

    torchrun --standalone --nproc-per-node 4 -m tpplan train --plan plans/llama.yaml
    tpplan train --plan plans/llama.yaml --nproc 4     # the same, launched for you
    tpplan train --plan plans/llama.yaml               # one process
"""

from __future__ import annotations

import argparse
import os
import sys

from ._common import add_plan_args


def register(sub) -> None:
    p = sub.add_parser("train", help="train the plan's model (TP + FSDP2, DCP checkpoints)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_plan_args(p)
    p.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="launch N local processes through torch.distributed.run (torchrun)")
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="PATH",
                   help="continue from the latest complete checkpoint of the run folder, or "
                        "from PATH (a step-N checkpoint or a folder holding them)")
    p.add_argument("--overwrite", action="store_true",
                   help="start over in a run folder that already holds checkpoints")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="override the automatic choice (cuda + nccl where GPUs are present)")
    p.set_defaults(run=run)


def _relaunch(args: argparse.Namespace) -> int:
    """Re-run this command under torchrun with ``--nproc`` local workers."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    argv = ["--standalone", f"--nproc-per-node={args.nproc}", "-m", "tpplan", "train",
            "--plan", args.plan]
    for o in args.overrides:
        argv += ["--set", o]
    if args.resume is not None:
        argv += ["--resume", args.resume]
    if args.overwrite:
        argv.append("--overwrite")
    if args.device:
        argv += ["--device", args.device]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        torchrun(argv)
    except ChildFailedError:  # the failing rank already printed why
        print(f"error: training failed on {args.nproc} processes", file=sys.stderr)
        return 1
    return 0


def run(args: argparse.Namespace) -> int:
    if args.nproc is not None:
        if args.nproc < 1:
            print("error: --nproc must be at least 1", file=sys.stderr)
            return 2
        if "RANK" in os.environ:
            print("error: --nproc is for launching; under torchrun leave it out", file=sys.stderr)
            return 2
        return _relaunch(args)
    from ..train import TrainError, train

    rank0 = os.environ.get("RANK", "0") == "0"
    try:
        train(args.plan, args.overrides, args.resume, args.overwrite, args.device)
    except TrainError as e:
        # Raised before the process group on every rank alike: say it once, fail everywhere.
        if rank0:
            print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
