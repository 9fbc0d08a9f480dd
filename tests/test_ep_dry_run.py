"""The dry run's expert-parallel figures that need no process (docs/moe.md, "The dry run"):
the minimum's expected distinct remote ranks against every routing enumerated, the worst
case's rows, and ``--device`` fit proposing ep (and checkpointing the HF model's own blocks),
each proposal checked by a dry run. The figures against a real gloo run:
tests/test_expert_parallel.py."""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
from types import SimpleNamespace

import pytest
from helpers import ROOT

from tpplan.analysis import ANALYSES
from tpplan.analysis.dryrun import dry_run
from tpplan.analysis.comm.experts import ExpertsModule, distinct_remote_ranks, expert_all_to_all
from tpplan.analysis.memory.fit import fit, needed
from tpplan.plan.devices import DEVICES

pytest.importorskip("transformers")
sys.path.insert(0, str(ROOT / "scripts"))

import sweep_hf  # noqa: E402


@pytest.mark.parametrize("experts, k, ep", [(8, 3, 4), (16, 4, 4), (12, 2, 3), (8, 8, 2)])
def test_distinct_remote_ranks_is_the_mean_over_every_routing(experts, k, ep):
    local = experts // ep
    for rank in range(ep):
        counts = [len({e // local for e in chosen} - {rank})
                  for chosen in itertools.combinations(range(experts), k)]
        assert distinct_remote_ranks(experts, k, ep) == pytest.approx(sum(counts) / len(counts))


def test_worst_case_rows_are_bounded_by_the_experts_one_rank_holds():
    """``ep · T · min(k, E/ep)`` rows arrive at the busiest rank per data all-to-all."""
    dims = SimpleNamespace(ep=4)
    shape = SimpleNamespace(grad_accum=1, micro_batch=2, seq_len=8)
    for experts, k in ((16, 3), (8, 3)):  # L = 4 >= k, then L = 2 < k
        mod = ExpertsModule("m", experts, k, 10, ((experts, 4, 10),), 4, True, True)
        a = expert_all_to_all([mod], dims, shape, 2)
        rows = 4 * 16 * min(k, experts // 4)
        assert a["worst_case_bytes"] == experts * 8 + 4 * rows * 10 * 2
        assert a["balanced_bytes"] == experts * 8 + 4 * 16 * k * 10 * 2
        assert a["count"] == 5


def test_fit_proposes_expert_parallelism_and_checkpoints_the_hf_blocks(tmp_path):
    config = tmp_path / "moe.json"
    config.write_text(json.dumps(sweep_hf.tiny_config(  # experts big beside the activations
        "qwen3_moe", num_experts=8, moe_intermediate_size=512)))
    plan = tmp_path / "moe.yaml"
    plan.write_text(f"mesh: {{dp_shard: -1}}\nmodel: {{hf_config: {config}}}\n"
                    'fsdp: {units: [model.embed_tokens, "model.layers.*", '
                    "[model.norm, lm_head]]}\ntrain: {seq_len: 16, global_batch_size: 8}\n")
    memory = [a for a in ANALYSES if a[0] == "memory_per_rank"]
    base = dry_run(str(plan), 4, [], memory)
    assert base.ok, (base.errors, base.analysis_errors)
    device = dataclasses.replace(DEVICES["h100"],  # just too small for the plan as written
                                 memory=needed(base.extra["memory_per_rank"]["peak"]) - 1)
    f = fit(base, device, str(plan), [])
    changes = {c["change"].split(" (")[0]: c for c in f["changes"]}
    rule = "tensor_parallel.model.layers.*.mlp.experts=expert_parallel"
    for ep in (2, 4):
        c = changes[f"expert parallelism ep {ep}"]
        assert c["set"] == [f"mesh.ep={ep}", rule] and c["error"] is None, c
        assert c["peak"] < f["peak"]  # a block gathers E/ep experts, not E
    ac = changes["activation checkpointing of every block"]
    assert ac["set"] == ['activation_checkpointing={mode: full, blocks: "model.layers.*"}']
    assert ac["error"] is None and ac["peak"] < f["peak"], ac


# A user's MoE written the ordinary way (tests/user_moe.py: grouped experts set in __init__,
# a sigmoid top-3 router, a shared MLP, torch.where inside the experts' loop)
USER_MOE = """mesh: {{ep: {ep}, dp_shard: -1}}
model: {{factory: 'user_moe:user_moe_gpt', kwargs: {{num_experts: 8, top_k: 3}}}}
tensor_parallel:
  "layers.*.mlp.experts": expert_parallel
fsdp: {{units: ["layers.*"]}}
train: {{seq_len: 32, global_batch_size: {batch}}}
"""


def test_validate_sizes_a_user_moe_with_data_dependent_experts(tmp_path, capsys):
    """``validate`` at 64 ranks of experts that pick their rows with ``torch.where``: memory
    per rank and the experts' all-to-all are computed (the ``nonzero`` given its balanced
    size), and the report says so."""
    from helpers import run_main

    plan = tmp_path / "user-moe.yaml"
    plan.write_text(USER_MOE.format(ep=8, batch=128))
    rc, out = run_main(capsys, "validate", "--plan", plan, "--world-size", "64", "--strict")
    assert rc == 0 and "could not be computed" not in out, out
    assert "peak" in out and "experts' all-to-all: 10 per step" in out
    assert "GroupedExperts: its data-dependent operators (nonzero) sized under balanced routing" in out


def test_user_moe_dry_run_peak_is_a_real_step(tmp_path):
    """The dry run's memory of the same user MoE at ep 4 on 4 ranks against one real step of
    it on gloo (tests/memory_measure.py), within the 10% the other plans are held to: real
    routing is not balanced, and the peak holds all the same."""
    from memory_measure import compare, measure_worker

    from tpplan.parallel.runtime import spawn

    plan = tmp_path / "user-moe.yaml"
    plan.write_text(USER_MOE.format(ep=4, batch=8))
    memory = [a for a in ANALYSES if a[0] == "memory_per_rank"]
    predicted = dry_run(str(plan), 4, [], memory)
    assert predicted.ok, (predicted.errors, predicted.analysis_errors)
    spawn(measure_worker, 4, str(plan), [], str(tmp_path))
    measured = json.loads((tmp_path / "measured.json").read_text())
    rows = {r["part"]: r for r in compare(predicted.extra["memory_per_rank"], measured)}
    assert abs(rows["peak"]["ratio"] - 1) <= 0.10, rows["peak"]
    assert abs(rows["parameters"]["ratio"] - 1) <= 0.10, rows["parameters"]


def test_search_ranks_layouts_of_a_user_moe_with_data_dependent_experts(tmp_path):
    """``search`` over the same user MoE, ep 2 and 4 in its space: its candidates are traced
    like validate's (the ``nonzero`` inside the experts given its balanced size), so every
    candidate passes or is dropped for a reason of the plan (no pipeline section for pp),
    none as impossible to size, and the ranked ones carry their peak."""
    from tpplan.analysis.search.candidates import Options
    from tpplan.analysis.search.ranking import search
    from tpplan.plan.devices import DEVICES

    plan = tmp_path / "user-moe.yaml"
    plan.write_text(USER_MOE.format(ep=1, batch=16))
    out = search(str(plan), 8, DEVICES["h100"], options=Options(max_tp=1, schedules=(), ep=(2, 4)), top=4)
    dropped = {d["reason"]: d["count"] for d in out["dropped"]}
    assert all("pipeline" in reason for reason in dropped), dropped
    assert out["passed_checks"] + sum(dropped.values()) == out["candidates"]
    assert any("ep: 2" in c for d in out["dropped"] for c in d["example"])  # ep was in the space
    assert out["ranked"] and all(r["peak"] > 0 for r in out["ranked"]), out["ranked"]
