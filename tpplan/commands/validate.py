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
    from ..analysis.dryrun import dry_run

    if args.world_size < 1:
        print("error: --world-size must be at least 1", file=sys.stderr)
        return 2
    result = dry_run(args.plan, args.world_size, args.overrides, ANALYSES)
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
    for e in result.analysis_errors:
        what = TITLES.get(e.analysis, e.analysis)
        print(f"error: {what} could not be computed for this model: {e.message}", file=sys.stderr)
    if result.analysis_errors:
        out.print(f"[red]the plan is valid, but {len(result.analysis_errors)} of its analyses "
                  f"failed[/red] (reasons above; {result.seconds:.2f} s)")
        return 1
    out.print(f"[green]valid[/green] ({result.seconds:.2f} s)")
    return 0


PART_NAMES = {
    "parameters": "parameters (local shards)", "buffers": "buffers and the batch",
    "optimizer": "optimizer state", "gradients": "gradients (sharded)",
    "fsdp_unsharded": "fsdp_unsharded (gathered params)",
    "accumulated_gradients": "accumulated_gradients (unsharded)",
    "activations": "activations (saved for backward)",
    "transients": "transients (backward, buffers)"}


def render_memory(out, mem: dict[str, Any]) -> None:
    from rich.table import Table

    b = mem["batch"]
    accum = f", {b['grad_accum']} micro-batches" if b["grad_accum"] > 1 else ""
    t = Table(title=f"memory per rank (micro-batch {b['micro_batch_size']} × seq {b['seq_len']}"
                    f"{accum}, {b['compute_dtype']} compute, AdamW)", header_style="bold")
    t.add_column("part")
    t.add_column("largest", justify="right")
    t.add_column("at the peak", justify="right")
    for part, name in PART_NAMES.items():
        t.add_row(name, size(mem[part]), size(mem["at_peak"][part]))
    t.add_row("total (each part at its largest)", size(mem["total"]), "")
    t.add_row("[bold]peak[/bold]", "", f"[bold]{size(mem['peak'])}[/bold]")
    out.print(t)
    out.print(f"peak: {mem['peak_at']}")


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
    style = f"a Megatron-style {mini['style']} plan"
    if mini["at_minimum"]:
        out.print(f"[green]TP at the minimum[/green]: {style} moves "
                  f"{size(mini['wire_bytes'])} per rank per step over tp too")
        return
    colour = {"above": "yellow", "below": "cyan"}.get(mini["verdict"], "yellow")
    out.print(f"[{colour}]TP {mini['verdict']} the minimum[/{colour}]: "
              f"{size(mini['measured_wire_bytes'])} per rank per step over tp, {style} needs "
              f"{size(mini['wire_bytes'])}")
    for e in mini["extra"]:
        sign = "+" if e["bytes"] >= 0 else "-"
        out.print(Text(f"  {e['count']:+d} {e['kind']} in {e['pass']} "
                       f"({sign}{size(abs(e['bytes']))})"))
    for r in mini["reasons"]:
        out.print(Text(f"  why: {r['reason']}"))
