"""The cost model's terms on cases computed by hand (docs/search.md): a single matmul-bound
block, a communication-bound tiny model, a bubble-dominated pipeline; the constants'
options; calibration on a real ``tpplan train`` run."""

from __future__ import annotations

import pytest
from helpers import PLANS

from tpplan.analysis import ANALYSES
from tpplan.analysis.cost import DEFAULT_CONSTANTS, CostConstants, estimate_step, links
from tpplan.analysis.dryrun import dry_run
from tpplan.plan.devices import Device

PLAN = str(PLANS / "llama.yaml")
DEV = Device("test", 80 * 2**30, bf16_flops=100e12, intra_node_bandwidth=400e9,
             inter_node_bandwidth=20e9)
C = CostConstants(compute_efficiency=0.5, intra_node_efficiency=0.8, inter_node_efficiency=0.5,
                  fsdp_overlap=0.9, tp_overlap=0.0)


def _run(world: int, *sets: str):
    r = dry_run(PLAN, world, list(sets), ANALYSES)
    assert r.ok, (r.errors, r.analysis_errors)
    return r


def _forward_per_token(cfg, seq: int) -> tuple[float, float]:
    """(one block's forward FLOPs per token, the head's): 2 × weights, plus attention's
    QKᵀ and AV (2 × 2 × s × d) in the block."""
    d, kv = cfg.dim, cfg.n_kv_heads * cfg.head_dim
    block = 2 * (2 * d * d + 2 * d * kv + 3 * d * cfg.hidden_dim) + 4 * seq * d
    return block, 2 * d * cfg.vocab_size


def test_a_single_matmul_bound_block():
    """One wide block on one rank: compute is 3 × forward FLOPs × tokens over the efficient
    peak, full checkpointing adds one forward of the block, nothing else costs."""
    sets = ["model.kwargs={n_layers: 1, dim: 512, n_heads: 8, n_kv_heads: 8}", "mesh.tp=1",
            "train.seq_len=64", "train.global_batch_size=4",
            "activation_checkpointing={mode: full}"]
    r = _run(1, *sets)
    cfg = r.model.config
    block, head = _forward_per_token(cfg, 64)
    tokens = 4 * 64
    e = estimate_step(r, DEV, 8, C)
    speed = DEV.bf16_flops * C.compute_efficiency
    assert e.terms["compute"] == pytest.approx(3 * (block + head) * tokens / speed)
    assert e.terms["recompute"] == pytest.approx(block * tokens / speed)
    assert e.dominant == "compute"
    assert e.step_time == pytest.approx(e.terms["compute"] + e.terms["recompute"])
    assert e.mfu == pytest.approx(3 * (block + head) * tokens / (e.step_time * DEV.bf16_flops))
    assert e.tokens_per_s_per_device == pytest.approx(tokens / e.step_time)


def test_a_comm_bound_tiny_model():
    """The debug Llama over tp 2 × dp_shard 2 with one GPU per node: every collective goes
    over the slow network, and the FSDP collectives hide behind compute only up to it."""
    r = _run(4, "mesh.tp=2", "train.seq_len=32", "train.global_batch_size=4")
    e = estimate_step(r, DEV, 1, C)
    assert links(dict(tp=2, dp_shard=2), 1) == {"tp": "inter", "dp_shard": "inter", "dp": "inter"}
    rows = r.extra["comm_per_step"]["collectives"]
    bw = DEV.inter_node_bandwidth * C.inter_node_efficiency
    tp = sum(x["wire_bytes"] for x in rows if x["source"] == "tp") / bw
    fsdp = [x for x in rows if x["source"] == "fsdp"]
    raw = sum(x["wire_bytes"] for x in fsdp) / bw
    # Exposed whatever happens: each micro-batch's first all-gather, the last reduce-scatter.
    first = sum(x["wire_bytes"] / bw * (r.step.grad_accum if x["kind"] == "all_gather" else 1)
                / x["count"] for x in fsdp)
    busy = e.terms["compute"] + e.terms["recompute"]
    assert e.terms["tp"] == pytest.approx(tp)
    assert e.terms["fsdp"] == pytest.approx(raw - min(C.fsdp_overlap * (raw - first), busy))
    assert e.dominant in ("tp", "fsdp") and e.terms["tp"] + e.terms["fsdp"] > 50 * busy
    # The same plan inside one node: tp over NVLink (one direction, half the quoted figure).
    inside = estimate_step(r, DEV, 8, C)
    assert inside.terms["tp"] == pytest.approx(
        tp * bw / (DEV.intra_node_bandwidth / 2 * C.intra_node_efficiency))


def test_a_bubble_dominated_pipeline():
    """GPipe over 4 stages with 2 micro-batches: idle (p-1)/m = 1.5 times the busiest rank's
    work; that rank is the last (four blocks' worth of layers less, but the head)."""
    r = _run(4, "mesh={pp: 4, dp_replicate: 1, dp_shard: 1, tp: 1}", "fsdp=null",
             "train.seq_len=32", "train.global_batch_size=4",
             "pipeline={schedule: gpipe, microbatches: 2}")
    assert r.extra["pipeline"]["bubble_fraction"] == pytest.approx(3 / 2)
    cfg = r.model.config
    block, head = _forward_per_token(cfg, 32)
    blocks_last = r.extra["pipeline"]["stages"][-1]["blocks"]
    assert blocks_last == cfg.n_layers // 4
    e = estimate_step(r, DEV, 8, C)
    tokens = 4 * 32
    speed = DEV.bf16_flops * C.compute_efficiency
    assert e.terms["compute"] == pytest.approx(3 * (blocks_last * block + head) * tokens / speed)
    assert e.terms["bubble"] == pytest.approx(1.5 * (e.terms["compute"] + e.terms["tp"]))
    assert e.dominant == "bubble"
    assert e.terms["pp_p2p"] > 0 and e.terms["fsdp"] == e.terms["dp"] == 0


def test_the_mesh_decides_each_dimensions_link():
    sizes = dict(pp=4, dp_replicate=2, dp_shard=4, tp=8)  # tp fills a node of 8
    assert links(sizes, 8) == {"tp": "intra", "dp_shard": "inter", "dp": "inter",
                               "dp_replicate": "inter", "pp": "inter"}
    assert links(dict(dp_shard=4, tp=2), 8) == {"tp": "intra", "dp_shard": "intra", "dp": "intra"}
    assert links(dict(dp_shard=8, tp=2), 8)["dp_shard"] == "inter"


def test_constants_from_the_command_line():
    c = DEFAULT_CONSTANTS.with_values("compute=0.4, fsdp_overlap=0, inter_node_efficiency=0.7")
    assert (c.compute_efficiency, c.fsdp_overlap, c.inter_node_efficiency) == (0.4, 0.0, 0.7)
    assert c.tp_overlap == DEFAULT_CONSTANTS.tp_overlap and "compute_efficiency=0.4" in c.source
    for bad, says in (("speed=1", "unknown constant 'speed'"), ("compute=x", "must be a number"),
                      ("compute=0", "must be in (0, 1]"), ("intra_node=1.5", "must be in")):
        with pytest.raises(ValueError, match=says.replace("(", r"\(").replace("]", r"\]")):
            DEFAULT_CONSTANTS.with_values(bad)


def test_calibration_reproduces_a_real_runs_step_time(reference_run, capsys):
    """``calibrate`` on a real ``tpplan train`` run (one CPU process): with no communication
    every term scales as 1/efficiency, so the fit is the estimate at efficiency 1 over the
    measured median step, and the fitted model gives that step back. ``validate
    --calibrate`` says which constants it used and how well they reproduce the run."""
    import json
    from dataclasses import replace

    from helpers import run_main

    from tpplan.analysis.calibration import measured_step
    from tpplan.analysis.cost import calibrate

    metrics = reference_run / "metrics.jsonl"
    measured = measured_step(metrics)
    cpu = Device("cpu", 8 * 2**30, bf16_flops=50e9, intra_node_bandwidth=2e9,
                 inter_node_bandwidth=1e9)
    fitted = calibrate([metrics], None, [], cpu, 1)
    r = dry_run(str(reference_run / "plan.yaml"), 1, [], ANALYSES)
    at_one = estimate_step(r, cpu, 1, replace(DEFAULT_CONSTANTS, compute_efficiency=1.0))
    assert fitted.compute_efficiency == pytest.approx(at_one.step_time / measured["step_time"],
                                                      rel=1e-3)
    assert estimate_step(r, cpu, 1, fitted).step_time == pytest.approx(measured["step_time"],
                                                                       rel=1e-3)
    assert fitted.source.startswith(f"calibrated from {metrics}")
    code, out = run_main(capsys, "validate", "--plan", reference_run / "plan.yaml",
                         "--world-size", 1, "--device", "h100", "--calibrate", metrics, "--json")
    st = json.loads(out)["step_time"]
    assert code == 0 and st["constants"]["source"].startswith("calibrated from")
    assert st["calibration"][0]["ratio"] == pytest.approx(1.0, rel=1e-3)
    with pytest.raises(SystemExit) as exit_:  # a usage error, as argparse's, no traceback
        run_main(capsys, "validate", "--plan", PLAN, "--world-size", 1, "--device", "h100",
                 "--calibrate", reference_run / "nothing.jsonl")
    assert exit_.value.code == 2 and "nothing.jsonl: no such file" in capsys.readouterr().err
