"""``tpplan validate``: check a plan against its model at any world size, on a laptop."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from . import steptime
from ._common import (add_plan_args, bad_world_size, console, device_from_args, fewer_collections,
                      print_errors, size)


TITLES = {"memory_per_rank": "memory per rank", "comm_per_step": "communication per step"}


def register(sub) -> None:
    p = sub.add_parser("validate", help="dry-run a plan at any world size (meta + fake PG)",
                       description=__doc__)
    add_plan_args(p)
    p.add_argument("--world-size", type=int, required=True, help="number of ranks to check at")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    p.add_argument("--device", metavar="NAME",
                   help="check memory per rank against a device preset (h100, h200, a100-80gb, "
                        "a100-40gb, l40s) and, if it does not fit, changes that make it fit; "
                        "and estimate the step time on it (docs/search.md)")
    p.add_argument("--device-memory", metavar="SIZE",
                   help="the same against a capacity, e.g. 80GiB or 85520809984")
    p.add_argument("--html", metavar="FILE",
                   help="also write the result as one self-contained page (mesh, modules, "
                        "memory, communication), drawn from the --json data")
    steptime.add_args(p)
    p.add_argument("--strict", action="store_true",
                   help="exit 1 when an analysis (memory, communication) cannot be computed "
                        "for this model; without it such a failure is reported and the exit "
                        "status follows the plan's own errors")
    p.add_argument("--require-fit", action="store_true",
                   help=f"with --device or --device-memory: exit {EXIT_DOES_NOT_FIT} when a rank "
                        "does not fit (or its memory could not be computed), for CI jobs that "
                        "gate on the verdict; plan errors still exit 1")
    p.set_defaults(run=run)


EXIT_DOES_NOT_FIT = 3  # the plan is valid, but a rank does not fit the device (--require-fit)


def _fit_status(result, args: argparse.Namespace) -> int:
    """``--require-fit``: :data:`EXIT_DOES_NOT_FIT` with one line saying why, else 0."""
    if not args.require_fit:
        return 0
    verdict = result.extra.get("fit")
    if verdict is None:
        print("error: --require-fit: cannot tell whether a rank fits: memory per rank could "
              "not be computed", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    if not verdict["fits"]:
        print(f"error: --require-fit: a rank needs {size(verdict['needed'])}, more than "
              f"{verdict['device']['name']}'s {size(verdict['capacity'])}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    return 0


def run(args: argparse.Namespace) -> int:
    with fewer_collections():  # the imports below and the dry run
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from ..analysis import ANALYSES
    from ..analysis.dryrun import dry_run

    if bad_world_size(args.world_size, "--world-size"):
        return 2
    device = device_from_args(args)
    if args.require_fit and device is None:
        print("error: --require-fit needs --device or --device-memory", file=sys.stderr)
        return 2
    constants, calibration = steptime.constants(args, device)
    from ..train.pretrained import plan_problems
    from .replicas import dry_run_overrides, render_replicas, replica_traffic

    args.overrides = dry_run_overrides(args.plan, list(args.overrides))  # fault_tolerance's groups

    result = dry_run(args.plan, args.world_size, args.overrides, steptime.analyses(ANALYSES, device, calibration))
    if not result.errors:  # the HF checkpoint a plan starts from, against its model
        result.errors.extend(plan_problems(args.plan, args.overrides))
    if device is not None and "peak" in result.extra.get("memory_per_rank", {}):
        from ..analysis.memory.fit import fit

        result.extra["fit"] = fit(result, device, args.plan, args.overrides)
    if not result.errors and (ft := replica_traffic(args.plan, args.overrides, result.extra.get(
            "comm_per_step"), args.world_size)) is not None:
        result.extra["fault_tolerance"] = ft
    estimate = steptime.estimate(result, device, args, constants, calibration)
    if estimate is not None:
        result.extra["step_time"] = estimate
    if args.html:
        from .page import write_page

        write_page(args.html, "plan", result.to_json(), f"tpplan validate: {args.plan}",
                   f"world size {args.world_size}" + "".join(f", --set {o}" for o in args.overrides))
    if args.json:
        print(json.dumps(result.to_json(), indent=1))
        return 1 if result.errors or (args.strict and result.analysis_errors) else \
            _fit_status(result, args)
    if result.errors:
        print_errors(result.errors)
        return 1
    out = console(160)
    title = f"{args.plan} at world size {args.world_size}: {result.report.dims}"
    out.print(result.report.table(title=title))
    if "pp_ranks" in result.extra.get("memory_per_rank", {}):
        render_pipeline(out, result.extra["memory_per_rank"], result.extra["pipeline"])
    elif "total" in result.extra.get("memory_per_rank", {}):
        render_memory(out, result.extra["memory_per_rank"])
    if "comm_minimum" in result.extra:
        render_comm(out, result.extra["comm_per_step"], result.extra["comm_minimum"])
    for module, ops in result.extra.get("balanced_experts", {}).items():
        out.print(f"{module}: its data-dependent operators ({', '.join(ops)}) sized under "
                  "balanced routing (each expert an even share of its rows; docs/moe.md)",
                  highlight=False)
    if "cp_minimum" in result.extra:  # docs/long-context.md: the method's minimum
        cp = result.extra["cp_minimum"]
        verdict = "at its minimum" if cp["at_minimum"] else \
            f"above its minimum by {cp['extra']}"
        out.print(f"cp ({cp['method']}): {sum(r['count'] for r in cp['collectives'])} "
                  f"collectives per step, {verdict}", highlight=False)
    if "fault_tolerance" in result.extra:
        render_replicas(out, result.extra["fault_tolerance"])
    if "fit" in result.extra:
        render_fit(out, result.extra["fit"])
    if "step_time" in result.extra:
        steptime.render(out, result.extra["step_time"])
    if result.checkpoint_bytes:
        out.print(f"one training checkpoint (model + AdamW state, all ranks): "
                  f"{size(result.checkpoint_bytes)} on disk", highlight=False)
    for e in result.analysis_errors:
        what = TITLES.get(e.analysis, e.analysis)
        print(f"error: {what} could not be computed for this model: {e.message}", file=sys.stderr)
    if result.analysis_errors:
        out.print(f"[yellow]the plan is valid, but {len(result.analysis_errors)} of its "
                  f"analyses could not run[/yellow] (reasons above; {result.seconds:.2f} s)")
        return 1 if args.strict else _fit_status(result, args)
    _render_data(out, args)
    out.print(f"[green]valid[/green] ({result.seconds:.2f} s)")
    return _fit_status(result, args)


def _render_data(out, args: argparse.Namespace) -> None:
    """What a plan on token sources will eat: tokens per source, read, epochs (docs/data.md)."""
    from ..train.corpora import data_plan

    for line in data_plan(args.plan, args.overrides, args.world_size):
        out.print(line, markup=False, highlight=False)


PART_NAMES = {
    "parameters": "parameters (local shards)", "buffers": "buffers and the batch",
    "optimizer": "optimizer state", "gradients": "gradients (sharded)",
    "fsdp_unsharded": "fsdp_unsharded (gathered params)",
    "accumulated_gradients": "accumulated_gradients (unsharded)",
    "activations": "activations (saved for backward)",
    "transients": "transients (backward, buffers)"}


def render_memory(out, mem: dict[str, Any]) -> None:
    from rich.table import Table
    from rich.text import Text

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
    ex = mem.get("experts")
    if ex:
        out.print(Text(f"routed experts per rank: {ex['experts_per_rank']} of each of "
                       f"{ex['modules']} experts modules; parameters {size(ex['parameters'])}, "
                       f"gradients {size(ex['gradients'])}, AdamW {size(ex['optimizer'])} "
                       "(included above)"))


def render_pipeline(out, mem: dict[str, Any], pipe: dict[str, Any]) -> None:
    """Memory per pp rank, one column per reported rank (first, middle, last stage), and the
    schedule: micro-batches in flight, bubble."""
    from rich.table import Table
    from rich.text import Text

    b = mem["batch"]
    t = Table(title=f"memory per rank by pipeline stage ({pipe['schedule']}, {pipe['microbatches']}"
                    f" micro-batches of {b['micro_batch_size']} × seq {b['seq_len']}, "
                    f"{b['compute_dtype']} compute, AdamW)", header_style="bold")
    t.add_column("part")
    ranks = mem["pp_ranks"]
    for r in ranks:
        stages = ", ".join(str(s["index"]) for s in r["stages"])
        t.add_column(f"{r['position']}: pp rank {r['pp_rank']}\n(stage {stages})", justify="right")
    for part, name in PART_NAMES.items():
        t.add_row(name, *(size(r[part]) for r in ranks))
    t.add_row("  micro-batches in flight", *(
        " + ".join(str(s["in_flight"]) for s in r["stages"]) for r in ranks))
    t.add_row("total (each part at its largest)", *(size(r["total"]) for r in ranks))
    t.add_row("[bold]peak[/bold]", *(f"[bold]{size(r['peak'])}[/bold]" for r in ranks))
    out.print(t)
    for r in ranks:
        out.print(Text(f"peak of pp rank {r['pp_rank']}: {r['peak_at']}"))
    closed = pipe["bubble_closed_form"]
    formula = "" if closed is None else \
        f" = {'(p-1)/(v·m)' if pipe['stages_per_rank'] > 1 else '(p-1)/m'} ({closed:.4f})"
    out.print(Text(f"pipeline bubble: {pipe['bubble_fraction']:.4f} of compute time{formula}, "
                   f"p={pipe['pp']}, v={pipe['stages_per_rank']}, m={pipe['microbatches']}"))


def render_comm(out, comm: dict[str, Any], mini: dict[str, Any]) -> None:
    from rich.table import Table
    from rich.text import Text

    where = "" if "pp_rank" not in comm else \
        f", the busiest pp rank: {comm['pp_rank']}, stage {', '.join(map(str, comm['stages']))}"
    t = Table(title=f"communication per rank per optimizer step ({comm['grad_accum']} "
                    f"micro-batches{where})", header_style="bold")
    for col in ("source", "collective", "mesh dim", "count", "bytes", "wire bytes"):
        t.add_column(col, justify="right" if col in ("count", "bytes", "wire bytes") else "left")
    for r in comm["collectives"]:
        t.add_row(r["source"], r["kind"], r["mesh_dim"], str(r["count"]), size(r["bytes"]),
                  size(r["wire_bytes"]))
    out.print(t)
    ep = comm.get("ep_all_to_all")
    dense = bool(ep and ep.get("dense_modules"))  # Llama 4's: every token to every expert
    if ep:
        out.print(Text(f"experts' all-to-all: {ep['count']} per step, {size(ep['balanced_bytes'])}"
                       f" with balanced routing ({size(ep['balanced_wire_bytes'])} on the wire), "
                       f"at most {size(ep['worst_case_bytes'])} on one rank when every token "
                       "chooses that rank's experts" + (
                           f"; {ep['dense_modules']} experts module(s) take every token for "
                           "every expert (dense form): the same bytes whatever the routing"
                           if dense else "")))
    if mini.get("ep"):
        m = mini["ep"]
        sent = "every token's row for every expert (dense form)" if dense else \
            "one row per (token, expert) pair"
        out.print(Text(f"EP minimum: each token's hidden state to each distinct remote rank among"
                       f" its top-k, once: {size(m['wire_bytes'])} per rank per step over ep; "
                       f"the dispatch sends {sent}: "
                       f"{size(m['measured_wire_bytes'])} ({m['ratio']:.2f}×)"))
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


def render_fit(out, f: dict[str, Any]) -> None:
    from rich.table import Table
    from rich.text import Text

    a = f["assumptions"]
    d = f["device"]
    out.print(Text(f"fit on {d['name']} ({size(f['capacity'])} per GPU): peak {size(f['peak'])} "
                   f"+ {a['allocator_overhead']:.0%} allocator overhead + "
                   f"{size(a['runtime_reserve'])} CUDA context and NCCL (assumed) = "
                   f"{size(f['needed'])} per rank"))
    if f["fits"]:
        out.print(f"[green]fits[/green]: {size(f['headroom'])} free per rank")
        return
    out.print(f"[red]does not fit[/red]: {size(-f['headroom'])} short per rank")
    t = Table(title="changes, each checked by dry-running the plan again", header_style="bold")
    for col in ("change", "--set", "peak", "needs", ""):
        t.add_column(col, justify="right" if col in ("peak", "needs") else "left")
    for c in f["changes"]:
        verdict = ("[green]fits[/green]" if c["fits"] else "[red]does not fit[/red]") \
            if c["error"] is None else f"[yellow]not possible[/yellow]: {c['error']}"
        t.add_row(c["change"], " ".join(c["set"]), size(c["peak"]), size(c["needed"]), verdict)
    out.print(t)
    if f["fitting"]:
        sets = " ".join(f"--set '{s}'" for s in f["fitting"]["set"])
        out.print(Text(f"fits with {f['fitting']['change']}: {sets} "
                       f"({size(f['capacity'] - f['fitting']['needed'])} free per rank)"))
    else:
        out.print("none of these fits; pipeline stages (mesh.pp and a pipeline section) would "
                  "divide the blocks' memory further, or more ranks per model replica (a larger tp)")
