"""``validate --device``'s estimated step time: options, computing it, printing it."""

from __future__ import annotations

import argparse
import sys
from typing import Any

TERM_NAMES = {
    "compute": "compute (forward + backward)", "recompute": "recompute (activation checkpointing)",
    "tp": "tp collectives (critical path)", "fsdp": "fsdp all-gather / reduce-scatter (exposed)",
    "dp": "dp_replicate all-reduce (exposed)", "pp_p2p": "pipeline send/recv",
    "bubble": "pipeline bubble", "ep": "ep all-to-all (exposed)", "cp": "cp exchange",
    "non_gemm": "non-GEMM kernels (memory-bound, launch floor)"}


def analyses(base: list, device, calibration) -> list:
    """The dry run's analyses for ``validate``: ``base``, and the step's non-GEMM kernels
    traced (:func:`tpplan.analysis.analyses.analyze_kernels`) where the step time will be
    estimated on a device with a memory bandwidth and no ``--calibrate`` (a calibrated
    ``compute_efficiency`` stands for them instead)."""
    if device is None or not device.bf16_flops or not device.memory_bandwidth or calibration is not None:
        return base
    from ..analysis.analyses import analyze_kernels

    return [*base, ("kernels", analyze_kernels)]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpus-per-node", type=int, default=8, metavar="N",
                   help="GPUs per node for the step-time estimate: a mesh dimension whose "
                        "groups fit in N consecutive ranks uses NVLink, else the network "
                        "(default 8)")
    p.add_argument("--cost", metavar="NAME=V,...", default="",
                   help="the cost model's constants, e.g. compute=0.45,fsdp_overlap=0.9 "
                        "(compute, intra_node, inter_node: fractions of peak; fsdp_overlap, "
                        "tp_overlap: fractions hidden; docs/search.md)")
    p.add_argument("--calibrate", metavar="METRICS", action="append", default=[],
                   help="fit compute efficiency to a `tpplan train` run's metrics.jsonl or run "
                        "folder (its plan.yaml gives the layout), repeatable: runs whose "
                        "communication shares differ also fit the links' efficiencies; "
                        "needs --device")


def constants(args: argparse.Namespace, device) -> tuple[Any, list[dict] | None]:
    """The constants ``--cost`` and ``--calibrate`` give (and the calibration's per-run
    report), or SystemExit(2) with the reason."""
    from ..analysis.cost.step_time import DEFAULT_CONSTANTS

    if args.gpus_per_node < 1:
        _fail(f"--gpus-per-node must be at least 1, got {args.gpus_per_node}")
    try:
        c = DEFAULT_CONSTANTS.with_values(args.cost)
    except ValueError as e:
        _fail(f"--cost {e}")
    if not args.calibrate:
        return c, None
    if device is None or not device.bf16_flops:
        _fail("--calibrate needs --device (a preset with a bf16 peak)")
    from pathlib import Path

    from ..analysis.cost.calibration import fit_report

    # A run folder stands for its metrics.jsonl.
    args.calibrate = [str(Path(m) / "metrics.jsonl") if Path(m).is_dir() else m
                      for m in args.calibrate]
    for m in args.calibrate:
        if not Path(m).is_file():
            _fail(f"--calibrate {m}: no such file")
    plans = [Path(m).parent / "plan.yaml" for m in args.calibrate]
    own = all(p.is_file() for p in plans)
    try:
        return fit_report(args.calibrate, None if own else args.plan,
                          [] if own else args.overrides, device, args.gpus_per_node, c)
    except ValueError as e:
        _fail(f"--calibrate {e}")


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def estimate(result, device, args, c, calibration) -> dict[str, Any] | None:
    """``step_time`` for the JSON: the estimate, or ``{"error": ...}``; None when there is
    nothing to estimate against (no device, or one without a bf16 peak)."""
    from ..analysis.cost.step_time import estimate_step

    kernels = result.extra.pop("kernels", None)  # priced into the estimate's non_gemm term
    if device is None or not device.bf16_flops or result.errors:
        return None
    if kernels is not None:
        result.extra["kernels"] = kernels
    try:
        out = estimate_step(result, device, args.gpus_per_node, c).to_json()
    except (ValueError, KeyError) as e:
        result.extra.pop("kernels", None)
        return {"error": f"{type(e).__name__}: {e}" if isinstance(e, KeyError) else str(e)}
    result.extra.pop("kernels", None)
    if calibration is not None:
        out["calibration"] = calibration
    return out


def render(out, st: dict[str, Any]) -> None:
    from rich.table import Table
    from rich.text import Text

    if "error" in st:
        out.print(Text(f"step time: not estimated: {st['error']}"))
        return
    d, c = st["details"], st["constants"]
    dev = d["device"]
    t = Table(title=f"estimated step time on {dev['name']} ({d['gpus_per_node']} per node; "
                    f"links: " + ", ".join(f"{k} {v}" for k, v in d["links"].items()
                                           if k != "dp") + ")", header_style="bold")
    t.add_column("term")
    t.add_column("seconds per step", justify="right")
    t.add_column("share", justify="right")
    for k, v in st["terms"].items():
        name = TERM_NAMES.get(k, k) + (" ◀" if k == st["dominant"] else "")
        t.add_row(name, f"{v:.4g}", f"{v / st['step_time']:.1%}" if st["step_time"] else "")
    t.add_row("[bold]step time[/bold]", f"[bold]{st['step_time']:.4g}[/bold]", "")
    out.print(t)
    out.print(Text(
        f"{st['tokens_per_s_per_device']:,.0f} tokens/s per device, MFU {st['mfu']:.1%} "
        f"({d['flops_per_token'] / 1e9:,.3g} GFLOP per token: 6 × {d['matmul_params']:,} matmul "
        f"weights + attention; {st['tokens_per_step']:,} tokens per step); dominant: "
        f"{st['dominant']}"))
    out.print(Text(
        f"constants ({c['source']}): compute {1.0 if d.get('non_gemm') else c['compute_efficiency']:.3g} × "
        f"{(dev.get('gemm_fraction') or 1.0):.3g} (a large GEMM's) of "
        f"{dev['bf16_flops'] / 1e12:,.1f} TFLOP/s, intra-node {c['intra_node_efficiency']:.3g} "
        f"of {_bw(dev['intra_node_bandwidth'])} (one direction: half), inter-node "
        f"{c['inter_node_efficiency']:.3g} of {_bw(dev['inter_node_bandwidth'])}, fsdp_overlap "
        f"{c['fsdp_overlap']:.3g}, tp_overlap {c['tp_overlap']:.3g}, ep_overlap "
        f"{c.get('ep_overlap', 0.0):.3g}; device figures: "
        "docs/search.md"))
    lat = {k: v for k, v in d.get("comm_latency_seconds", {}).items() if v}
    raw = d["comm_seconds_before_overlap"]
    out.print(Text(
        f"GEMM shapes: the rank's matmuls run at {d.get('gemm_efficiency', 1.0):.1%} of a large "
        f"GEMM's rate ({(dev.get('gemm_fraction') or 1.0):.3g} of the peak, measured, × "
        f"compute_efficiency); latency (α) in the collectives: "
        + (", ".join(f"{k} {v:.4g} s of {raw[k]:.4g} s" for k, v in lat.items()) or "none")))
    if d.get("non_gemm"):
        ng = d["non_gemm"]
        out.print(Text(f"non-GEMM: {ng['kernels']:,.0f} memory-bound kernels a step ({ng['bytes'] / 1e9:,.3g} GB "
                       f"at {ng['hbm_efficiency']:.3g} of {_bw(dev.get('memory_bandwidth'))}, each at least "
                       f"{ng['launch_s'] * 1e6:.3g} µs), traced; GEMMs at their own rate (compute_efficiency "
                       "not applied)"))
    first = d["first_unit_exposure"]
    if first:
        out.print(Text("overlap: " + "; ".join(
            f"{k} {raw[k]:.4g} s before overlap, of which {v:.4g} s can never hide (each "
            "micro-batch's first all-gather, the step's last reduction)"
            for k, v in first.items())))
    if d.get("whole_model_rows_scaled_by", 1.0) != 1.0:
        out.print(Text(f"pipeline: the dry run's TP/FSDP rows are the whole model's; scaled by "
                       f"the busiest pp rank's share of FLOPs ({d['whole_model_rows_scaled_by']:.3f})"))
    for r in st.get("calibration") or []:
        out.print(Text(f"calibration: {r['path']} (world size {r['world_size']}, "
                       f"{r['steps']} steps): measured {r['measured']:.4g} s, the fitted "
                       f"model gives {r['predicted']:.4g} s ({r['ratio']:.3f}×)"))


def _bw(v: float | None) -> str:
    return "n/a" if not v else f"{v / 1e9:,.0f} GB/s"
