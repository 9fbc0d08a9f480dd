"""``tpplan verify``: run a plan for real on N CPU processes and compare with one device.

The plan's model is shrunk to a tiny config of the same architecture (for built-in models;
a factory model is run as its ``model.kwargs`` say, so pass small sizes with ``--set``),
the plan's mesh is solved at N, and logits, loss and every parameter's gradient are
compared with the same model and batch on one device. Exit 1 above ``--tolerance``.
"""

from __future__ import annotations

import argparse
import sys
import time

from ..plan.patterns import generalize
from ._common import add_plan_args, console

__all__ = ["register", "group_rows"]


def register(sub) -> None:
    p = sub.add_parser("verify", help="check a plan's numerics on an N-process gloo CPU mesh",
                       description=__doc__)
    add_plan_args(p)
    p.add_argument("--nproc", type=int, required=True, help="number of CPU processes (ranks)")
    p.add_argument("--tolerance", type=float, default=1e-4,
                   help="worst relative error allowed (default 1e-4)")
    p.add_argument("--layers", type=int, default=2, help="blocks of the shrunk model (default 2)")
    p.add_argument("--seq-len", type=int, default=16, help="tokens per sequence (default 16)")
    p.add_argument("--batch-per-rank", type=int, default=2,
                   help="sequences per data-parallel rank (default 2)")
    p.add_argument("--no-shrink", action="store_true",
                   help="run the model at the size the plan names (only for small models)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=run)


def group_rows(rows: list[tuple[str, float]]) -> list[tuple[str, int, float]]:
    """Collapse per-layer rows (``layers.3.attention.wq``) into ``layers.*`` with the worst."""
    groups: dict[str, list] = {}
    for what, err in rows:
        key = generalize(what)
        g = groups.setdefault(key, [0, 0.0])
        g[0] += 1
        g[1] = max(g[1], err)
    return [(k, n, e) for k, (n, e) in groups.items()]


def run(args: argparse.Namespace) -> int:
    from rich.table import Table

    from ..analysis.verify.numerics import compare, parallel_step, reference_step, verify_step

    if args.nproc < 1:
        print("error: --nproc must be at least 1", file=sys.stderr)
        return 2
    start = time.perf_counter()
    step = verify_step(args.plan, args.nproc, args.overrides, args.layers, args.seq_len,
                       args.batch_per_rank, args.seed, shrink=not args.no_shrink)
    dims = step.plan.parallel_dims(args.nproc)
    ref = reference_step(step.plan, step.tokens, args.seed)
    par = parallel_step(args.plan, step.overrides, args.nproc, step.tokens, args.seed)
    result = compare(ref, par, args.tolerance)

    out = console(120)
    t = Table(title=f"{args.plan} on {args.nproc} gloo ranks ({dims}) vs one device",
              header_style="bold")
    for col in ("compared", "×", "worst relative error", ""):
        t.add_column(col, justify="right" if col.startswith(("×", "worst")) else "left")
    for what, n, err in group_rows(result.rows):
        ok = err <= args.tolerance
        t.add_row(what, str(n), f"{err:.2e}", "[green]ok[/green]" if ok else "[red]FAIL[/red]")
    out.print(t)
    took = time.perf_counter() - start
    if result.ok:
        out.print(f"[green]numerics match[/green] within {args.tolerance:g} ({took:.1f} s)")
        return 0
    out.print(f"[red]numerics differ[/red]: {len(result.failures)} of {len(result.rows)} "
                  f"above {args.tolerance:g} ({took:.1f} s)")
    return 1
