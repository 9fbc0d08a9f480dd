"""``tpplan validate``: check a plan against its model at any world size, on a laptop."""

from __future__ import annotations

import argparse
import json
import sys

from ..cli import add_plan_args, print_errors
from ..errors import PlanErrors


def register(sub) -> None:
    p = sub.add_parser("validate", help="dry-run a plan at any world size (meta + fake PG)",
                       description=__doc__)
    add_plan_args(p)
    p.add_argument("--world-size", type=int, required=True, help="number of ranks to check at")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    p.set_defaults(run=run)


def analyses() -> list:
    """Analyses run inside the dry run (memory, communication) when available."""
    try:
        from ..analysis import ANALYSES
    except ImportError:
        return []
    return list(ANALYSES)


def run(args: argparse.Namespace) -> int:
    from ..dryrun import dry_run

    if args.world_size < 1:
        print("error: --world-size must be at least 1", file=sys.stderr)
        return 2
    result = dry_run(args.plan, args.world_size, args.overrides, analyses())
    if args.json:
        print(json.dumps(result.to_json(), indent=1))
        return 0 if result.ok else 1
    if not result.ok:
        print_errors(PlanErrors(result.errors))
        return 1
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console.width = 160  # logs and pipes: wide enough for the table's columns
    title = f"{args.plan} at world size {args.world_size}: {result.report.dims}"
    console.print(result.report.table(title=title))
    for render in result.extra.get("_renderers", []):
        render(console)
    console.print(f"[green]valid[/green] ({result.seconds:.2f} s)")
    return 0
