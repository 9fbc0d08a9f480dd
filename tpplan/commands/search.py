"""``tpplan search``: which layout to run. Every mesh and option the plan leaves open at a
world size, checked as ``validate`` checks a plan, ranked by estimated tokens/s per device."""

from __future__ import annotations

import argparse
import json
import sys

from ._common import (add_plan_args, bad_world_size, console, device_from_args,
                      fewer_collections, size)


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a list of integers (e.g. 2,4)") from None


def register(sub) -> None:
    p = sub.add_parser("search", help="rank every layout of a plan by estimated tokens/s",
                       description=__doc__)
    add_plan_args(p)
    p.add_argument("--world-size", type=int, required=True, help="number of GPUs")
    p.add_argument("--device", required=True, metavar="NAME",
                   help="device preset (h100, h200, a100-80gb, a100-40gb, l40s)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--max-tp", type=int, default=None,
                   help="largest tp tried (default: --gpus-per-node, tp inside one node)")
    p.add_argument("--ac-every", type=_ints, default=(2,), metavar="K,...",
                   help="selective checkpointing periods tried besides none and full (default 2)")
    p.add_argument("--stages-per-rank", type=_ints, default=(2,), metavar="V,...",
                   help="stages per rank tried for the interleaved schedules (default 2)")
    p.add_argument("--top", type=int, default=10, help="how many layouts to show (default 10)")
    p.add_argument("--exhaustive", action="store_true",
                   help="check every candidate's memory, not only until --top fit")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    p.add_argument("--html", metavar="FILE", help="also write the ranked table as a page")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    with fewer_collections():  # as validate: millions of long-lived objects
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from ..analysis.search.candidates import Options
    from ..analysis.search.ranking import search

    if bad_world_size(args.world_size, "--world-size"):
        return 2
    args.device_memory = None  # search ranks by speed: a preset with its peak and links
    device = device_from_args(args)
    options = Options(max_tp=args.max_tp or args.gpus_per_node, ac_every=args.ac_every,
                      stages_per_rank=args.stages_per_rank)
    say = None if args.json else (lambda m: print(m, file=sys.stderr))
    data = search(args.plan, args.world_size, device, args.overrides, args.gpus_per_node,
                  options, args.top, exhaustive=args.exhaustive, progress=say)
    if args.html:
        from .page import write_page

        write_page(args.html, "search", data, f"tpplan search: {args.plan}",
                   f"{args.world_size} × {device.name}" +
                   "".join(f", --set {o}" for o in args.overrides))
    if args.json:
        print(json.dumps(data, indent=1))
        return 0
    render(console(200), data)
    return 0


def render(out, data: dict) -> None:
    from rich.table import Table
    from rich.text import Text

    t = Table(title=f"{data['plan']} on {data['world_size']} × {data['device']['name']} "
                    f"({data['gpus_per_node']} per node): the {len(data['ranked'])} fastest "
                    "layouts that fit", header_style="bold")
    for col in ("#", "tokens/s/GPU", "step", "MFU", "dominant", "headroom", "--set"):
        t.add_column(col, justify="right" if col in ("#", "tokens/s/GPU", "step", "MFU",
                                                      "headroom") else "left")
    for i, r in enumerate(data["ranked"], 1):
        t.add_row(str(i), f"{r['tokens_per_s_per_device']:,.0f}", f"{r['step_time']:.3g} s",
                  f"{r['mfu']:.1%}", r["dominant"], size(r["headroom"]),
                  Text(" ".join(f"--set '{s}'" for s in r["sets"])))
    out.print(t)
    left = data["not_ranked"]
    out.print(Text(f"{data['candidates']} candidates: {data['passed_checks']} pass the plan's "
                   f"checks, {data['fitting']} checked to fit; not analysed further, their bound "
                   f"already slower than the last layout shown: {left['fitting']} that fit, "
                   f"{left['comm_only']} bounded by their communication, {left['bound_only']} "
                   "by arithmetic alone; dropped:"))
    for d in data["dropped"]:
        out.print(Text(f"  {d['count']:>6}  {d['reason']}"))
    c = data["constants"]
    out.print(Text(f"cost constants ({c.get('source', '')}): " + ", ".join(
        f"{k}={v}" for k, v in c.items() if k != "source")))
    out.print(Text(f"tp at most {data['options']['max_tp']} (one node; --max-tp for more); "
                   f"traces run: {data['traces']}; {data['seconds']:.1f} s"))
