"""``tpplan lighthouse``: torchft's lighthouse for a fault-tolerant run on a cluster.

    tpplan lighthouse --plan plans/llama.yaml --port 29510     # the plan's min_replicas, timeouts
    tpplan lighthouse --min-replicas 1 --port 29510

The replica groups agree on membership through it each step; start it once, on a host every
group reaches, and give its address to each group (``fault_tolerance.lighthouse`` or the
TORCHFT_LIGHTHOUSE variable). ``tpplan train`` on one machine starts its own.
"""

from __future__ import annotations

import argparse
import socket
import sys


def register(sub) -> None:
    p = sub.add_parser("lighthouse", help="torchft's lighthouse for fault-tolerant replica groups",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", default=None, help="read min_replicas and the timeouts from this "
                   "plan's fault_tolerance section")
    p.add_argument("--min-replicas", type=int, default=None, metavar="N",
                   help="replica groups a quorum needs (default: the plan's, else 1)")
    p.add_argument("--port", type=int, default=29510)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import os

    from ..ft.groups import missing_extra
    from ..ft.launch import lighthouse_argv
    from ..plan.fault_tolerance import FaultToleranceSpec

    if problem := missing_extra():
        print(f"error: {problem}", file=sys.stderr)
        return 1
    spec = FaultToleranceSpec()
    if args.plan:
        from ..api import load

        spec = load(args.plan).spec.fault_tolerance or spec
    if args.min_replicas is not None:
        spec.min_replicas = args.min_replicas
    argv = lighthouse_argv(spec, args.port)
    print(f"tpplan lighthouse: http://{socket.gethostname()}:{args.port} (a quorum needs "
          f"{spec.min_replicas} replica group(s)): {' '.join(argv)}", flush=True)
    os.execv(argv[0], argv)  # the lighthouse itself, in this process; Ctrl-C stops it
    return 0
