"""The cost model's terms on cases computed by hand (docs/search.md): a single matmul-bound
block, a communication-bound tiny model, a bubble-dominated pipeline; the constants'
options; calibration on a real ``tpplan train`` run."""

from __future__ import annotations

from dataclasses import replace

import pytest
from helpers import PLANS

from tpplan.analysis import ANALYSES
from tpplan.analysis.cost.step_time import DEFAULT_CONSTANTS, CostConstants, estimate_step, links
from tpplan.analysis.dryrun import dry_run
from tpplan.plan.devices import Device

PLAN = str(PLANS / "llama.yaml")
DEV = Device("test", 80 * 2**30, bf16_flops=100e12, intra_node_bandwidth=400e9,
             inter_node_bandwidth=20e9)
NO_LATENCY = replace(DEV, collective_latency=0.0, intra_node_latency=0.0, inter_node_latency=0.0)
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


def _alpha_by_hand(row, n: int, per_step: float) -> float:
    """NCCL's ring model, written out: one base latency per call and one per step, ``2(n-1)``
    steps for an all-reduce, ``n-1`` for an all-gather or reduce-scatter."""
    steps = 2 * (n - 1) if row["kind"] == "all_reduce" else n - 1
    return row["count"] * (8.4e-6 + steps * per_step)


def test_a_comm_bound_tiny_model():
    """The debug Llama over tp 2 × dp_shard 2 with one GPU per node: every collective goes
    over the slow network, each call paying NCCL's latency for its algorithm's steps
    besides its bytes, and the FSDP collectives hide behind compute only up to it."""
    r = _run(4, "mesh.tp=2", "train.seq_len=32", "train.global_batch_size=4")
    e = estimate_step(r, DEV, 1, C)
    assert links(dict(tp=2, dp_shard=2), 1) == {"tp": "inter", "dp_shard": "inter", "dp": "inter"}
    rows = r.extra["comm_per_step"]["collectives"]
    bw = DEV.inter_node_bandwidth * C.inter_node_efficiency
    tp_rows = [x for x in rows if x["source"] == "tp" and x["wire_bytes"]]
    tp = sum(x["wire_bytes"] / bw + _alpha_by_hand(x, 2, 14.0e-6) for x in tp_rows)
    fsdp = [x for x in rows if x["source"] == "fsdp"]
    each = [x["wire_bytes"] / bw + _alpha_by_hand(x, 2, 14.0e-6) for x in fsdp]
    raw = sum(each)
    # Exposed whatever happens: each micro-batch's first all-gather, the last reduce-scatter.
    first = sum(t * (r.step.grad_accum if x["kind"] == "all_gather" else 1) / x["count"]
                for t, x in zip(each, fsdp))
    busy = e.terms["compute"] + e.terms["recompute"]
    assert e.terms["tp"] == pytest.approx(tp)
    assert e.terms["fsdp"] == pytest.approx(raw - min(C.fsdp_overlap * (raw - first), busy))
    assert e.dominant in ("tp", "fsdp") and e.terms["tp"] + e.terms["fsdp"] > 50 * busy
    assert e.details["comm_latency_seconds"]["tp"] == pytest.approx(
        sum(_alpha_by_hand(x, 2, 14.0e-6) for x in tp_rows))
    # The same plan inside one node: NVLink's bandwidth (one direction, half the quoted
    # figure) and NVLink's latency per step.
    inside = estimate_step(r, DEV, 8, C)
    nvlink = DEV.intra_node_bandwidth / 2 * C.intra_node_efficiency
    assert inside.terms["tp"] == pytest.approx(
        sum(x["wire_bytes"] / nvlink + _alpha_by_hand(x, 2, 3.4e-6) for x in tp_rows))


def test_a_bubble_dominated_pipeline():
    """GPipe over 4 stages with 2 micro-batches: idle (p-1)/m = 1.5 times the busiest rank's
    work; that rank is the last (four blocks' worth of layers less, but the head). Links
    without latency: at this size NCCL's per-send latency would dominate instead."""
    r = _run(4, "mesh={pp: 4, dp_replicate: 1, dp_shard: 1, tp: 1}", "fsdp=null",
             "train.seq_len=32", "train.global_batch_size=4",
             "pipeline={schedule: gpipe, microbatches: 2}")
    assert r.extra["pipeline"]["bubble_fraction"] == pytest.approx(3 / 2)
    cfg = r.model.config
    block, head = _forward_per_token(cfg, 32)
    blocks_last = r.extra["pipeline"]["stages"][-1]["blocks"]
    assert blocks_last == cfg.n_layers // 4
    e = estimate_step(r, NO_LATENCY, 8, C)
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

    from tpplan.analysis.cost.calibration import measured_step
    from tpplan.analysis.cost.step_time import calibrate

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


H100 = Device("h100-like", 80 * 2**30, bf16_flops=989.4e12, intra_node_bandwidth=900e9,
              inter_node_bandwidth=50e9, sms=132, memory_bandwidth=3.35e12)


def test_latency_dominates_tiny_messages_and_bandwidth_large_ones():
    """α–β: a 1 KiB all-reduce over 8 NVLink ranks costs NCCL's latency (8.4 µs + 2·7 steps
    × 3.4 µs), its bytes nothing; a 1 GiB one costs its ring bytes over the link, the
    latency nothing. Steps per algorithm: ring all-reduce 2(n-1), all-gather and
    reduce-scatter n-1, all-to-all n-1 (pairwise), a send 1; a group over k nodes pays the
    network's α on the k-1 steps per pass that cross nodes."""
    from tpplan.analysis.cost.collectives import collective_time, latency, steps

    assert [steps(k, 8) for k in ("all_reduce", "all_gather", "reduce_scatter",
                                  "all_to_all", "send")] == [14, 7, 7, 7, 1]
    assert steps("all_gather", 1) == 0 and collective_time("all_reduce", 2**30, 1, "intra", H100) == 0
    tiny = collective_time("all_reduce", 1024, 8, "intra", H100)
    assert tiny == pytest.approx(8.4e-6 + 14 * 3.4e-6, rel=1e-3)
    big = collective_time("all_reduce", 2**30, 8, "intra", H100)
    wire = 2 * 7 / 8 * 2**30 / (900e9 / 2)
    assert big - wire == pytest.approx(8.4e-6 + 14 * 3.4e-6) and (big - wire) / big < 0.02
    # Across nodes: 16 ranks, 8 per node: 1 of the 15 all-gather steps crosses the network.
    assert latency("all_gather", 16, "inter", H100, nodes=2) == pytest.approx(
        8.4e-6 + 14 * 3.4e-6 + 1 * 14.0e-6)
    assert latency("all_gather", 16, "inter", H100) == pytest.approx(8.4e-6 + 15 * 14.0e-6)
    # A device's own (measured) α replaces NCCL's: gloo over TCP.
    gloo = replace(H100, collective_latency=0.0, intra_node_latency=50e-6)
    assert latency("reduce_scatter", 4, "intra", gloo) == pytest.approx(3 * 50e-6)


def test_gemm_efficiency_rises_with_size_and_falls_with_unfriendly_shapes():
    """Tile and wave quantization and the roofline, by the formulas of docs/search.md:
    square GEMMs get faster per FLOP with size up to 1; one tile more than the SMs (133 on
    132) takes two waves; a dimension one past a tile wastes most of the next tile; a
    skinny GEMM (K = 64) is memory-bound."""
    from tpplan.analysis.cost.gemm import gemm_efficiency

    rate = H100.bf16_flops * 0.5
    sizes = [64, 256, 1024, 4096, 16384]
    eff = [gemm_efficiency(n, n, n, H100, rate) for n in sizes]
    assert eff == sorted(eff) and eff[0] < 0.01 and eff[-1] > 0.95
    assert gemm_efficiency(256 * 12, 128 * 11, 4096, H100, rate) == pytest.approx(1.0)  # 132 tiles
    assert gemm_efficiency(256 * 7, 128 * 19, 4096, H100, rate) == pytest.approx(133 / 264)
    aligned = gemm_efficiency(8192, 1024, 8192, H100, rate)  # 256 tiles: 2 waves, 97%
    assert gemm_efficiency(8192, 1025, 8192, H100, rate) == pytest.approx(  # 288: 3 waves
        aligned * 1025 / 1152 * (288 / 396) / (256 / 264))
    aligned = gemm_efficiency(8192, 8192, 8192, H100, rate)
    assert gemm_efficiency(8192, 8192, 8192 + 8, H100, rate) == pytest.approx(
        aligned * 8200 / (129 * 64))
    m, n, k = 16384, 16384, 64
    memory_time = 2 * (m * k + k * n + m * n) / H100.memory_bandwidth
    assert gemm_efficiency(m, n, k, H100, rate) == pytest.approx(2 * m * n * k / rate / memory_time)
    cpu = Device("cpu", 8 * 2**30, bf16_flops=50e9)  # no SMs, no memory figure: nothing lost
    assert gemm_efficiency(3, 5, 7, cpu, 50e9) == 1.0


def test_the_compute_term_reads_each_ranks_matrix_shapes():
    """At tp 2 a rank's Linears are half as wide (colwise outputs, rowwise inputs): the
    compute term is each GEMM's FLOPs over the rate times its own efficiency, summed. Here
    recomputed by hand for the single-block model on one rank, then the per-rank shapes at
    tp 2 make each FLOP slower than at tp 1."""
    from tpplan.analysis.cost.gemm import gemm_efficiency

    sets = ["model.kwargs={n_layers: 1, dim: 512, n_heads: 8, n_kv_heads: 8}",
            "train.seq_len=64", "train.global_batch_size=4", "fsdp=null",
            "mesh={pp: 1, dp_replicate: 1, dp_shard: 1, tp: 1}"]
    r = _run(1, *sets)
    e = estimate_step(r, H100, 8, C)
    cfg, rate = r.model.config, H100.bf16_flops * C.compute_efficiency
    rows = r.step.micro_batch * 64
    shapes = [(cfg.dim, cfg.dim)] * 4 + [(cfg.dim, cfg.hidden_dim)] * 2 + \
        [(cfg.hidden_dim, cfg.dim), (cfg.dim, cfg.vocab_size)]  # (in, out): wq wk wv wo w1 w3 w2 head
    seconds = sum(2 * i * o * (1 / gemm_efficiency(rows, o, i, H100, rate)
                               + 1 / gemm_efficiency(rows, i, o, H100, rate)
                               + 1 / gemm_efficiency(o, i, rows, H100, rate)) for i, o in shapes)
    hd = cfg.dim // cfg.n_heads
    attn = 0.5 / gemm_efficiency(64, 64, hd, H100, rate, r.step.micro_batch * cfg.n_heads) + \
        0.5 / gemm_efficiency(64, hd, 64, H100, rate, r.step.micro_batch * cfg.n_heads)
    seconds += 3 * 4 * 64 * cfg.dim * attn
    assert e.terms["compute"] == pytest.approx(seconds * 4 * 64 / rate)
    assert 0 < e.details["gemm_efficiency"] < 0.2  # a 512-wide model on 64 rows: small tiles
    tp2 = estimate_step(_run(2, *sets[:-1], "mesh={pp: 1, dp_replicate: 1, dp_shard: 1, tp: 2}"),
                        H100, 8, C)
    assert tp2.details["gemm_efficiency"] < e.details["gemm_efficiency"]


def test_a_tiny_model_is_latency_bound():
    """The README's search example (the debug Llama, 64 tokens a sequence, 8 H100s): its
    collectives are latency, not bytes, and it runs far below the peak (before α and GEMM
    shapes it ranked at 22 million tokens/s per GPU with a step of "0.00 s")."""
    from tpplan.plan.devices import DEVICES

    r = _run(8, "mesh.tp=2", "train.seq_len=64", "train.global_batch_size=16")
    e = estimate_step(r, DEVICES["h100"])
    lat = e.details["comm_latency_seconds"]
    raw = e.details["comm_seconds_before_overlap"]
    assert lat["tp"] > 0.9 * raw["tp"] and e.dominant == "tp"
    assert e.mfu < 0.01 and e.step_time > 1e-4


def test_expert_and_context_parallel_terms():
    """The seam for EP and CP: an all-to-all sends (n-1)/n of its buffer in n-1 pairwise
    steps; ring attention hides each rotation behind a block's attention and shows only
    what a rotation takes beyond it; all-gather CP is an all-gather on the critical path.
    Rows of source ``ep`` in ``comm_per_step`` become the ``ep`` term, hidden up to
    ``ep_overlap``."""
    from tpplan.analysis.cost import step_time as cost

    a2a = cost.all_to_all_time(64 * 2**20, 8, "intra", H100)
    assert a2a == pytest.approx(8.4e-6 + 7 * 3.4e-6 + 7 / 8 * 64 * 2**20 / 450e9)
    assert cost.all_to_all_time(64 * 2**20, 16, "inter", H100, nodes=2) > a2a
    send = cost.collective_time("send", 2**20, 4, "intra", H100)
    assert send == pytest.approx(8.4e-6 + 3.4e-6 + 2**20 / 450e9)
    assert cost.ring_attention_time(2**20, 4, "intra", 4 * send, H100) == 0.0  # hidden
    assert cost.ring_attention_time(2**20, 4, "intra", 4 * send / 2, H100) == pytest.approx(
        3 * send / 2)
    assert cost.cp_all_gather_time(2**20, 4, "intra", H100) == pytest.approx(
        8.4e-6 + 3 * 3.4e-6 + 3 * 2**20 / 450e9)
    r = _run(4, "mesh.tp=2", "train.seq_len=32", "train.global_batch_size=4")
    r.extra["comm_per_step"]["collectives"].append(dict(
        source="ep", kind="all_to_all", mesh_dim="dp_shard", count=10, bytes=10 * 2**20,
        wire_bytes=10 * 2**20 // 2))
    e = estimate_step(r, H100, 8, C)
    one = cost.all_to_all_time(2**20, 2, "intra", H100, C)
    assert e.terms["ep"] == pytest.approx(10 * one)
    hidden = estimate_step(r, H100, 8, replace(C, ep_overlap=0.5))
    assert hidden.terms["ep"] == pytest.approx(5 * one)


def test_the_bound_never_exceeds_the_estimate():
    """``step_time_bound`` (what ``search`` ranks untraced candidates by) is at most the final
    estimate, with latency and GEMM shapes in both, across layouts drawn at random: tp,
    data-parallel split, pipeline, checkpointing, micro-batch, nodes of 1, 2 or 8 GPUs. With
    the FSDP2 rows from arithmetic alone (``fsdp_rows``: each pp rank's, no trace), the
    bound takes the FSDP and DP terms too: still at most the estimate, above the bound
    without them where FSDP2 is exposed, and those rows are the analysis's own (the
    busiest pp rank's under a pipeline)."""
    import random

    from tpplan.analysis import fsdp_rows, traced_rows
    from tpplan.analysis.cost.step_time import step_time_bound
    from tpplan.plan.devices import DEVICES

    rng = random.Random(27)
    none = "activation_checkpointing={mode: none}"
    layouts = [("mesh={pp: 1, dp_replicate: 1, dp_shard: 2, tp: 4}", "train.micro_batch_size=2"),
               ("mesh={pp: 2, dp_replicate: 2, dp_shard: 1, tp: 2}",
                "pipeline={schedule: 1f1b, microbatches: 4}"),
               ("mesh={pp: 1, dp_replicate: 2, dp_shard: 4, tp: 1}",
                "activation_checkpointing={mode: selective, every: 2}"),
               ("mesh={pp: 2, dp_replicate: 1, dp_shard: 4, tp: 1}",
                "pipeline={schedule: interleaved_1f1b, microbatches: 4, stages_per_rank: 2}",
                "activation_checkpointing={mode: full}"),
               ("mesh={pp: 1, dp_replicate: 1, dp_shard: 2, tp: 4}", "train.micro_batch_size=2",
                "activation_checkpointing={mode: selective, every: 2}"),
               ("mesh={pp: 2, dp_replicate: 1, dp_shard: 2, tp: 2}",
                "pipeline={schedule: interleaved_1f1b, microbatches: 4, stages_per_rank: 2}",
                "activation_checkpointing={mode: full}")]
    tighter = with_tp = 0
    for sets in layouts:
        r = _run(8, "train.seq_len=64", "train.global_batch_size=16", *sets)
        rows = fsdp_rows(r)
        comm = r.extra["comm_per_step"]
        busiest = rows[comm.get("pp_rank", 0)]
        assert len(rows) == r.resolution.dims.pp and busiest and \
            busiest == [row for row in comm["collectives"] if row["source"] == "fsdp"]
        # The same layout without checkpointing: its TP trace's rows, each at most this one's.
        recomputes = r.plan.spec.activation_checkpointing.enabled
        plain = traced_rows(_run(8, "train.seq_len=64", "train.global_batch_size=16", *sets,
                                 none)) if recomputes else None
        for mine, theirs in zip(traced_rows(r), plain or []):
            by = {(x["source"], x["kind"], x["mesh_dim"]): x for x in mine}
            for x in theirs:
                y = by[(x["source"], x["kind"], x["mesh_dim"])]
                assert x["count"] <= y["count"] and x["wire_bytes"] <= y["wire_bytes"], (sets, x)
        for _ in range(3):
            dev = DEVICES[rng.choice(["h100", "a100-80gb", "h200"])]
            c = replace(C, compute_efficiency=rng.uniform(0.2, 1.0),
                        fsdp_overlap=rng.uniform(0, 1), tp_overlap=rng.uniform(0, 1))
            gpn = rng.choice([1, 2, 8])
            step = estimate_step(r, dev, gpn, c).step_time
            alone = step_time_bound(r, dev, c)
            with_fsdp = step_time_bound(r, dev, c, fsdp=rows, gpus_per_node=gpn)
            assert alone <= with_fsdp <= step
            tighter += with_fsdp > alone
            if plain is not None:
                traced = step_time_bound(r, dev, c, fsdp=rows, gpus_per_node=gpn, traced=plain)
                assert with_fsdp <= traced <= step
                with_tp += traced > with_fsdp
    assert tighter >= 6 and with_tp >= 4


def test_calibration_fits_what_the_runs_tell_apart(tmp_path):
    """Step times made by the model itself at planted constants (compute 0.3, NVLink 0.6),
    for two layouts whose communication shares differ (FSDP over dp_shard 2, hidden behind
    compute up to its overlap; TP 2 on the critical path): both runs together recover both
    constants; one run alone pins only compute efficiency (one number, one constant), and
    reproduces its own step."""
    import json

    from tpplan.analysis.cost.calibration import fit_report

    dev = Device("cpu", 8 * 2**30, bf16_flops=50e9, intra_node_bandwidth=2e9,
                 inter_node_bandwidth=1e9, collective_latency=0.0, intra_node_latency=20e-6)
    truth = replace(C, compute_efficiency=0.3, intra_node_efficiency=0.6)
    paths = []
    for name, tp in (("a", 1), ("b", 2)):
        run = tmp_path / name
        run.mkdir()
        (run / "plan.yaml").write_text(
            f"extends: {PLAN}\nmesh: {{tp: {tp}, dp_shard: -1, dp_replicate: 1}}\n"
            "train: {seq_len: 64, global_batch_size: 4}\n")
        step = estimate_step(dry_run(str(run / "plan.yaml"), 2, [], ANALYSES), dev, 8,
                             truth).step_time
        rows = [dict(step=i, step_time_s=step, tokens_per_s=256 / step,
                     tokens_per_s_per_device=128 / step) for i in range(3)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
        paths.append(run / "metrics.jsonl")
    start = replace(C, compute_efficiency=0.5, intra_node_efficiency=0.9)
    both, report = fit_report(paths, None, [], dev, 8, start)
    assert report[0]["fitted"] == ["compute_efficiency", "intra_node_efficiency"]
    assert both.compute_efficiency == pytest.approx(0.3, rel=1e-3)
    assert both.intra_node_efficiency == pytest.approx(0.6, rel=1e-3)
    assert [r["ratio"] for r in report] == pytest.approx([1.0, 1.0], rel=1e-4)
    one, report = fit_report(paths[1:], None, [], dev, 8, start)
    assert report[0]["fitted"] == ["compute_efficiency"] and one.intra_node_efficiency == 0.9
    assert report[0]["ratio"] == pytest.approx(1.0, rel=1e-4)


@pytest.mark.parametrize("sets", [[], ["model.kwargs.top_k=1", "model.kwargs.moe_every=2",
                                        "model.kwargs.shared_hidden=64"]])
def test_a_mixture_of_experts_counts_the_experts_a_token_runs_through(sets):
    """The compute term of a MoE counts ``top_k`` experts' weights per token (the active
    weights), not every expert's nor none: counted here from the parameters' own shapes."""
    import torch

    import tpplan
    from tpplan.analysis.cost.flops import model_flops
    from tpplan.models import build_model

    plan = tpplan.load(PLANS / "moe.yaml", sets)
    model = build_model(plan.model, "meta")
    k = plan.model.kwargs.get("top_k", 2)
    expert = sum(p.numel() // p.shape[0] * k for name, p in model.named_parameters()
                 if ".experts." in name)  # one expert's, k times
    dense = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    flops = model_flops(model, 64)
    assert flops.matmul_params == dense + expert
    assert sum(flops.forward.values()) == 2 * (dense + expert) + \
        4 * 64 * flops.attention_width * len(flops.blocks)
