"""``tpplan report``: a training run's curves and the plan it ran, as a table or one page;
several runs side by side: their curves overlaid, how their plans differ, and the first step
where their losses part."""

from __future__ import annotations

import argparse
import json
import sys


def register(sub) -> None:
    p = sub.add_parser("report", help="a run folder's metrics and plan, or several runs side by "
                       "side (terminal, --json or --html)", description=__doc__)
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                   help="the run folder `tpplan train` wrote; two or more: compared with the "
                        "first")
    p.add_argument("--html", metavar="FILE", help="write one self-contained page: loss, validation "
                   "loss, tokens/s and grad norm over steps, and the plan's mesh, memory and "
                   "communication (several runs: the curves overlaid and the plans' differences)")
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    p.add_argument("--world-size", type=int, help="the run's world size (default: from its metrics)")
    p.add_argument("--tolerance", type=float, default=None, metavar="REL",
                   help="several runs: the relative loss difference where runs part (default: 0 "
                        "for runs of the same plan and world size, 1e-4 for other layouts)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..analysis.runs.report import RunError

    try:
        if len(args.run_dirs) > 1:
            return _compare(args)
        return _single(args)
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def _page_or_json(args: argparse.Namespace, kind: str, data: dict, title: str,
                  subtitle: str) -> bool:
    """Write ``--html`` (a page of ``kind``) and print ``--json``; False when the JSON was
    printed, so nothing more goes to the terminal."""
    if args.html:
        from .page import write_page

        write_page(args.html, kind, data, title, subtitle)
    if args.json:
        print(json.dumps(data, indent=1))
        return False
    return True


def _single(args: argparse.Namespace) -> int:
    from ..analysis.runs.report import run_report
    from ._common import console, size

    run_dir = args.run_dirs[0]
    data = run_report(run_dir, args.world_size)
    if not _page_or_json(args, "run", data, f"tpplan report: {run_dir}",
                         f"plan {data['run']['plan_source'] or 'plan.yaml'}"):
        return 0
    out = console(120)
    rows = data["run"]["metrics"]
    if rows:
        first, last = rows[0], rows[-1]
        evl = last.get("eval_loss", last.get("val_loss"))
        out.print(f"{run_dir}: {len(rows)} steps logged, {first['step']}..{last['step']}; "
                  f"loss {first.get('loss', float('nan')):.4g} -> {last.get('loss', float('nan')):.4g}"
                  + (f", validation loss {evl:.4g}" if evl is not None else "")
                  + f"; {last.get('tokens_per_s', 0):,.0f} tokens/s at the last step")
    else:
        out.print(f"{run_dir}: no step logged yet")
    events = [f"step {e['step']} {e['event']} ({e['replicas']} replica groups)" for e in data["run"]["events"]]
    if events:  # fault tolerance (docs/fault-tolerance.md): where groups were lost and came back
        out.print("replica groups: " + ", ".join(events), highlight=False)
    plan = data["plan"]
    if plan is None:
        out.print(f"plan: {data['plan_error']}")
    else:
        mem = plan.get("memory_per_rank", {})
        out.print(f"plan: {'valid' if plan['ok'] else 'not valid'} at world size "
                  f"{data['run']['world_size']}" + (f"; peak memory per rank {size(mem['peak'])}"
                                                     if "peak" in mem else ""))
    est = data["run"].get("estimate") or {}
    measured, predicted = est.get("measured") or {}, est.get("dry_run") or {}
    if measured.get("peak_bytes") and predicted.get("peak_bytes"):
        out.print(f"the run: peak {size(measured['peak_bytes'])} per rank measured "
                  f"({measured.get('how')}) against the dry run's {size(predicted['peak_bytes'])}"
                  f" (×{measured['peak_bytes'] / predicted['peak_bytes']:.2f})", soft_wrap=True)
    traced = [p for p in data["run"].get("profile") or [] if p and p.get("trace")]
    if traced:
        from pathlib import Path

        steps = [r["step"] for r in traced[0]["steps"]]
        out.print(f"profile: steps {steps[0]}..{steps[-1]}, {len(traced)} ranks' traces in "
                  f"{Path(traced[0]['trace']).parent}", soft_wrap=True, highlight=False)
    if args.html:
        out.print(f"wrote {args.html}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from ..analysis.runs.compare import compare_runs
    from ._common import console

    data = compare_runs(args.run_dirs, args.tolerance)
    if not _page_or_json(args, "runs", data, f"tpplan report: {len(args.run_dirs)} runs",
                         f"baseline {data['baseline']}"):
        return 0
    out = console(140)
    for r in data["runs"]:
        rows = r["metrics"]
        last = rows[-1] if rows else {}
        mesh = " × ".join(f"{k} {v}" for k, v in (r["mesh"] or {}).items() if v > 1) or "-"
        out.print(f"{r['dir']}: {len(rows)} steps, mesh {mesh}, final loss "
                  f"{last.get('loss', float('nan')):.6g}, {last.get('tokens_per_s', 0):,.0f} "
                  f"tokens/s", highlight=False)
    if data["differences"]:
        out.print("the plans differ in:")
        for d in data["differences"]:
            out.print(f"  {d['key']}: " + " | ".join(json.dumps(v) for v in d["values"]),
                      highlight=False)
    else:
        out.print("the plans are the same")
    for p in data["partings"]:
        where = (f"part at step {p['step']}: loss {p['loss']:.8g} against {p['base_loss']:.8g} "
                 f"(relative {p['relative']:.2e})" if p["step"] is not None else
                 f"agree on all {p['common_steps']} common steps (largest relative difference "
                 f"{p['largest_relative']:.2e})")
        out.print(f"{p['run']} against {data['baseline']}: {where}; tolerance "
                  f"{p['tolerance']:g} ({p['why']})", highlight=False)
    if args.html:
        out.print(f"wrote {args.html}")
    return 0
