"""``tpplan report``: a training run's curves and the plan it ran, as a table or one page."""

from __future__ import annotations

import argparse
import json
import sys


def register(sub) -> None:
    p = sub.add_parser("report", help="a run folder's metrics and plan (terminal, --json or --html)",
                       description=__doc__)
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run folder `tpplan train` wrote")
    p.add_argument("--html", metavar="FILE", help="write one self-contained page: loss, validation "
                   "loss, tokens/s and grad norm over steps, and the plan's mesh, memory and "
                   "communication")
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    p.add_argument("--world-size", type=int, help="the run's world size (default: from its metrics)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..analysis.runreport import RunError, run_report
    from ._common import console, size

    try:
        data = run_report(args.run_dir, args.world_size)
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.html:
        from .page import write_page

        write_page(args.html, "run", data, f"tpplan report: {args.run_dir}",
                   f"plan {data['run']['plan_source'] or 'plan.yaml'}")
    if args.json:
        print(json.dumps(data, indent=1))
        return 0
    out = console(120)
    rows = data["run"]["metrics"]
    if rows:
        first, last = rows[0], rows[-1]
        out.print(f"{args.run_dir}: {len(rows)} steps logged, {first['step']}..{last['step']}; "
                  f"loss {first.get('loss', float('nan')):.4g} -> {last.get('loss', float('nan')):.4g}"
                  + (f", validation loss {last['val_loss']:.4g}" if "val_loss" in last else "")
                  + f"; {last.get('tokens_per_s', 0):,.0f} tokens/s at the last step")
    else:
        out.print(f"{args.run_dir}: no step logged yet")
    plan = data["plan"]
    if plan is None:
        out.print(f"plan: {data['plan_error']}")
    else:
        mem = plan.get("memory_per_rank", {})
        out.print(f"plan: {'valid' if plan['ok'] else 'not valid'} at world size "
                  f"{data['run']['world_size']}" + (f"; peak memory per rank {size(mem['peak'])}"
                                                     if "peak" in mem else ""))
    if args.html:
        out.print(f"wrote {args.html}")
    return 0
