"""Per-operator activation checkpointing (``activation_checkpointing: op``) priced as what it
recomputes, and tried by ``search`` where a layout does not fit without checkpointing: its
recompute term is the matmuls the policy does not save (every second Linear of a block, none
of attention), its memory-bound operators recomputed are in the traced non-GEMM term."""

from __future__ import annotations

from dataclasses import replace

from helpers import PLANS

from tpplan.analysis import ANALYSES
from tpplan.analysis.analyses import analyze_kernels
from tpplan.analysis.cost.step_time import estimate_step, flops_of
from tpplan.analysis.dryrun import dry_run
from tpplan.analysis.memory.fit import needed
from tpplan.analysis.search.candidates import Options
from tpplan.analysis.search.ranking import search
from tpplan.plan.devices import DEVICES

PLAN = str(PLANS / "llama.yaml")
# One rank, no FSDP, one micro-batch of 2 × 512 tokens: activations are most of the peak.
ONE = ["mesh={tp: 1, dp_shard: 1}", "train.seq_len=512", "train.global_batch_size=2", "fsdp=null"]
MODES = {"none": "{mode: none}", "op": "{mode: op}", "selective": "{mode: selective, every: 2}",
         "full": "{mode: full}"}


def _runs() -> dict:
    out = {}
    for name, ac in MODES.items():
        r = dry_run(PLAN, 1, ONE + ["train.micro_batch_size=2", f"activation_checkpointing={ac}"],
                    ANALYSES + [("kernels", analyze_kernels)])
        assert r.ok, (r.errors, r.analysis_errors)
        out[name] = (r, estimate_step(r, DEVICES["h100"]))
    return out


def test_op_is_priced_between_none_and_full_and_search_takes_it_where_only_it_fits():
    runs = _runs()
    est = {k: e for k, (_, e) in runs.items()}
    # Recompute: the unsaved matmuls, not the whole forward; its memory-bound operators as
    # many as full's (both recompute every one of them), none for a step that keeps all.
    assert 0 < est["op"].terms["recompute"] < est["full"].terms["recompute"]
    assert est["op"].terms["non_gemm"] == est["full"].terms["non_gemm"] > est["none"].terms["non_gemm"]
    assert est["none"].step_time < est["op"].step_time < est["full"].step_time
    # The recomputed matmuls are every second Linear of each block, at the rank's rate.
    r, e = runs["op"]
    linears = flops_of(r).linears["layers.0"]
    recomputed = sum(2 * i * o for n, (_, i, o) in enumerate(linears) if n % 2)
    assert 0 < recomputed < sum(2 * i * o for _, i, o in linears) / 2 + 1
    assert e.details["rank_flops_per_step"] == runs["none"][1].details["rank_flops_per_step"] + \
        recomputed * len(r.resolution.ac_blocks) * 2 * 512

    # A device where op fits and neither none nor selective does: search ranks op first,
    # ahead of full (which fits, and recomputes more).
    need = {k: needed(r.extra["memory_per_rank"]["peak"]) for k, (r, _) in runs.items()}
    assert need["full"] < need["op"] < min(need["selective"], need["none"])
    device = replace(DEVICES["h100"], memory=(need["op"] + min(need["selective"], need["none"])) // 2)
    got = search(PLAN, 1, device, ONE, options=Options(max_tp=1), top=3)
    first = got["ranked"][0]
    assert "activation_checkpointing={mode: op}" in first["sets"], first["sets"]
    assert "train.micro_batch_size=2" in first["sets"]
    assert abs(first["step_time"] - est["op"].step_time) <= 1e-9 * est["op"].step_time
    assert got["op_twins"] >= 1
    assert any("mode: full" in " ".join(row["sets"]) for row in got["ranked"][1:])
    # With op not tried, full is what fits first: the same search ranks it first.
    without = search(PLAN, 1, device, ONE, options=Options(max_tp=1, op=False), top=1)
    assert "mode: full" in " ".join(without["ranked"][0]["sets"]) and without["op_twins"] == 0


def test_op_memory_matches_a_real_step(tmp_path):
    """The dry run's memory under per-operator checkpointing against the same step run for real
    on a gloo mesh (tests/memory_measure.py: dp_shard 2 × tp 2, two micro-batches), part by
    part and the peak, within 10%."""
    import json

    from memory_measure import CASES, compare, measure_worker

    from tpplan.parallel.runtime import spawn

    plan, world, overrides = CASES["2x2, full checkpointing"]
    overrides = [o.replace("mode: full", "mode: op") for o in overrides]
    predicted = dry_run(str(PLANS / plan), world, overrides, [a for a in ANALYSES if a[0] == "memory_per_rank"])
    assert predicted.ok and predicted.plan.spec.activation_checkpointing.mode == "op"
    spawn(measure_worker, world, str(PLANS / plan), overrides, str(tmp_path))
    rows = compare(predicted.extra["memory_per_rank"], json.loads((tmp_path / "measured.json").read_text()))
    off = [r for r in rows if abs(r["ratio"] - 1) > 0.10]
    assert not off, "\n".join(f"{r['part']}: predicted {r['predicted']}, measured {r['measured']}" for r in off)
    assert {r["part"] for r in rows} >= {"activations", "peak"}
