"""``tpplan search``'s cache of TP traces: a pipeline's stage resolutions and traces
(tpplan/analysis/comm/stages.py) shared across pp, stages per rank, schedules and
checkpointing modes where they read none of them, and a trace (a stage's or a whole
model's) past three micro-batch sizes extrapolated from them, checked affine; every
communication row (every pp rank's) equal to an uncached dry run's."""

from __future__ import annotations

from collections import Counter

import pytest
from helpers import PLANS, TEST_PLANS
from test_search import _evaluated

from tpplan.analysis import ANALYSES
from tpplan.analysis.dryrun import dry_run
from tpplan.analysis.comm.tp_batch import extrapolated
from tpplan.analysis.comm.tp_trace import TPTrace

COMM = [a for a in ANALYSES if a[0] == "comm_per_step"]


def _pp_ranks(plan: str, world: int, overrides: list[str], variants: list[list[str]],
              part: str = "pp_ranks") -> tuple[Counter, list]:
    """Every variant's communication rows (per pp rank) through one :class:`Evaluator`."""
    ev, results = _evaluated(overrides, world, variants, plan, memory=False)
    return ev.traces, [r.extra["comm_per_step"][part] for r in results]


def _uncached(plan: str, world: int, overrides: list[str], variants: list[list[str]],
              part: str = "pp_ranks") -> list:
    return [dry_run(plan, world, overrides + s, COMM).extra["comm_per_step"][part]
            for s in variants]


def _variants(pp: int, dp: int, tp: int, pipes: list[str], acs: list[str]) -> list[list[str]]:
    mesh = f"mesh={{pp: {pp}, dp_replicate: 1, dp_shard: {dp}, tp: {tp}}}"
    return [[mesh, f"activation_checkpointing={ac}", f"pipeline={p}"] for ac in acs for p in pipes]


# Micro-batches of 1, 2, 4 and 8 sequences (16 a rank): the fourth from the first three.
BATCHES = [f"{{schedule: 1f1b, microbatches: {m}}}" for m in (16, 8, 4, 2)]


@pytest.mark.parametrize("ac", ["{mode: none}", "{mode: full}",
                                "{mode: selective, every: 2}"])
def test_stage_traces_extrapolated_in_the_micro_batch_equal_uncached(ac):
    overrides = ["train.seq_len=32", "train.global_batch_size=32", "model.kwargs.n_layers=8"]
    variants = _variants(2, 2, 2, BATCHES, [ac])
    traces, cached = _pp_ranks(str(PLANS / "llama.yaml"), 8, overrides, variants)
    assert traces["stage_tp_from_batches"] == 2, traces  # both stages at the fourth size
    assert cached == _uncached(str(PLANS / "llama.yaml"), 8, overrides, variants)


def test_stages_alike_across_pp_placement_and_checkpointing_share_resolutions_and_traces():
    """Four stages of an 8-block Llama, as pp 2 × 2 stages a rank (interleaved, and the V
    of ZBV) and as pp 4, under no and full checkpointing: one resolution per stage, and
    the traces of alike stages shared; every pp rank's rows as an uncached dry run's."""
    overrides = ["train.seq_len=32", "train.global_batch_size=32", "model.kwargs.n_layers=8"]
    acs = ["{mode: none}", "{mode: full}"]
    variants = _variants(2, 4, 2, ["{schedule: interleaved_1f1b, microbatches: 4, "
                                   "stages_per_rank: 2}",
                                   "{schedule: zbv, microbatches: 4}"], acs) + \
        _variants(4, 2, 2, ["{schedule: 1f1b, microbatches: 8}"], acs)  # 2 a micro-batch
    traces, cached = _pp_ranks(str(PLANS / "llama.yaml"), 16, overrides, variants)
    assert traces["stage_resolutions"] == 4, traces
    # Two checkpointing modes, and at most four different stages (first, last, middle
    # ones of each length) each: the other stages' traces come from the cache.
    assert traces["stage_tp"] <= 8 and traces["stage_tp_cached"] >= 4 * 6 - 8, traces
    assert cached == _uncached(str(PLANS / "llama.yaml"), 16, overrides, variants)


def test_an_hf_pipelines_stage_traces_extrapolate_in_the_micro_batch():
    """transformers' Llama as pipeline stages (its own TP plan, pp 2 × tp 2): the fourth
    micro-batch size from the first three, equal to an uncached dry run."""
    pytest.importorskip("transformers")
    overrides = ["model.config.num_hidden_layers=4", "train.seq_len=32",
                 "train.global_batch_size=32"]
    variants = [["mesh={pp: 2, dp_replicate: 1, dp_shard: 2, tp: 2}", f"pipeline={p}"]
                for p in BATCHES]
    plan = str(TEST_PLANS / "hf" / "llama-pp.yaml")
    traces, cached = _pp_ranks(plan, 8, overrides, variants)
    assert traces["stage_tp_from_batches"] == 2, traces
    assert cached == _uncached(plan, 8, overrides, variants)


def _trace(counts: dict) -> TPTrace:
    return TPTrace(Counter(counts), [], None)


def test_a_trace_is_extrapolated_only_where_its_three_points_are_affine():
    """Activation bytes ``a·b``, a gradient's reduction constant: extrapolated to b = 8. A
    collective off the line, one missing at a size, or an input not on its line: None."""
    act, grad = ("all_gather", "tp", False), ("all_reduce", "tp", True)

    def at(b: int, off: int = 0) -> TPTrace:
        return _trace({(*act, 64 * b + off, "layers.*.attention"): 2,
                       (*grad, 512, "<gradients>"): 1})

    sent = [((b, 32, 128), "bf16") for b in (1, 2, 4, 8)]
    points = [(b, None, at(b), s) for b, s in zip((1, 2, 4), sent)]
    trace, out = extrapolated(points, 8, None)
    assert trace.counts == at(8).counts and out == sent[3]
    bent = points[:2] + [(4, None, at(4, off=1), sent[2])]
    assert extrapolated(bent, 8, None) is None
    missing = points[:2] + [(4, None, _trace({(*act, 256, "layers.*.attention"): 2}), sent[2])]
    assert extrapolated(missing, 8, None) is None
    received = [(b, ((b, 32, 128), "bf16"), at(b), s) for b, s in zip((1, 2, 4), sent)]
    assert extrapolated(received, 8, ((8, 32, 128), "bf16"))[0].counts == at(8).counts
    assert extrapolated(received, 8, ((8, 16, 128), "bf16")) is None


@pytest.mark.parametrize("plan,world,mesh,overrides", [
    ("llama.yaml", 4, "dp_shard: 2, tp: 2", ["activation_checkpointing={mode: selective, every: 2}"]),
    ("llama.yaml", 8, "dp_shard: 2, cp: 2, tp: 2", []),  # ring attention's sends
    ("qwen3-moe-ep-tiny.yaml", 2, "dp_shard: 2, ep: 2, tp: 1", []),  # the experts' all-to-all
])
def test_whole_model_traces_extrapolated_in_the_micro_batch_equal_uncached(plan, world, mesh,
                                                                           overrides):
    """Without a pipeline: micro-batches of 1, 2, 4 and 8, the fourth from the first three."""
    overrides = ["train.seq_len=32", "train.global_batch_size=32", *overrides]
    variants = [[f"mesh={{pp: 1, dp_replicate: 1, {mesh}}}", f"train.micro_batch_size={b}"]
                for b in (1, 2, 4, 8)]
    traces, cached = _pp_ranks(str(PLANS / plan), world, overrides, variants, "collectives")
    assert traces["tp_from_batches"] == 1 and traces["tp"] == 3, traces
    assert cached == _uncached(str(PLANS / plan), world, overrides, variants, "collectives")
