"""``tpplan validate``: check a plan against its model at any world size, on a laptop."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ._common import add_plan_args, console, print_errors, size


TITLES = {"memory_per_rank": "memory per rank", "comm_per_step": "communication per step"}


def register(sub) -> None:
    p = sub.add_parser("validate", help="dry-run a plan at any world size (meta + fake PG)",
                       description=__doc__)
    add_plan_args(p)
    p.add_argument("--world-size", type=int, required=True, help="number of ranks to check at")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..analysis import ANALYSES
    from ..analysis.dryrun import dry_run, world_size_problem

    problem = world_size_problem(args.world_size)
    if problem:
        print(f"error: --world-size {problem}", file=sys.stderr)
        return 2
    from ..train.pretrained import plan_problems

    result = dry_run(args.plan, args.world_size, args.overrides, ANALYSES)
    if not result.errors:  # the HF checkpoint a plan starts from, against its model
        result.errors.extend(plan_problems(args.plan, args.overrides))
    if args.json:
        print(json.dumps(result.to_json(), indent=1))
        return 0 if result.ok else 1
    if result.errors:
        print_errors(result.errors)
        return 1
    out = console(160)
    title = f"{args.plan} at world size {args.world_size}: {result.report.dims}"
    out.print(result.report.table(title=title))
    if "total" in result.extra.get("memory_per_rank", {}):
        render_memory(out, result.extra["memory_per_rank"])
    if "comm_minimum" in result.extra:
        render_comm(out, result.extra["comm_per_step"], result.extra["comm_minimum"])
    if result.checkpoint_bytes:
        out.print(f"one training checkpoint (model + AdamW state, all ranks): "
                  f"{size(result.checkpoint_bytes)} on disk", highlight=False)
    for e in result.analysis_errors:
        what = TITLES.get(e.analysis, e.analysis)
        print(f"error: {what} could not be computed for this model: {e.message}", file=sys.stderr)
    if result.analysis_errors:
        out.print(f"[red]the plan is valid, but {len(result.analysis_errors)} of its analyses "
                  f"failed[/red] (reasons above; {result.seconds:.2f} s)")
        return 1
    out.print(f"[green]valid[/green] ({result.seconds:.2f} s)")
    return 0


def render_memory(out, mem: dict[str, Any]) -> None:
    from rich.table import Table

    b = mem["batch"]
    t = Table(title=f"memory per rank (micro-batch {b['micro_batch_size']} × seq {b['seq_len']}, "
                    f"{b['compute_dtype']} compute, AdamW)", header_style="bold")
    t.add_column("part")
    t.add_column("bytes", justify="right")
    for part in ("parameters", "gradients", "optimizer", "fsdp_unsharded", "activations", "total"):
        t.add_row(part, size(mem[part]))
    out.print(t)


def render_comm(out, comm: dict[str, Any], mini: dict[str, Any]) -> None:
    from rich.table import Table
    from rich.text import Text

    t = Table(title=f"communication per rank per optimizer step ({comm['grad_accum']} "
                    "micro-batches)", header_style="bold")
    for col in ("source", "collective", "mesh dim", "count", "bytes", "wire bytes"):
        t.add_column(col, justify="right" if col in ("count", "bytes", "wire bytes") else "left")
    for r in comm["collectives"]:
        t.add_row(r["source"], r["kind"], r["mesh_dim"], str(r["count"]), size(r["bytes"]),
                  size(r["wire_bytes"]))
    out.print(t)
    if mini["at_minimum"]:
        out.print(f"[green]TP at the minimum[/green]: a Megatron-style {mini['style']} plan "
                  f"moves {size(mini['wire_bytes'])} per rank per step over tp too")
        return
    out.print(f"[yellow]TP above the minimum[/yellow]: {size(mini['measured_wire_bytes'])}"
              f" per rank per step over tp, a Megatron-style {mini['style']} plan needs "
              f"{size(mini['wire_bytes'])}")
    for e in mini["extra"]:
        out.print(Text(f"  +{e['count']} {e['kind']} in {e['pass']} (+{size(e['bytes'])})"))
    for r in mini["reasons"]:
        out.print(Text(f"  why: {r['reason']}"))
