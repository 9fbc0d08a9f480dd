"""One memory trace serves every ``dp_shard`` of a layout (:mod:`tpplan.analysis.memory.dp_shards`):
the moments ``search`` scales from a step traced at another dp_shard equal those of a dry
run at that dp_shard, moment for moment, on several layouts; where scaling would not be
exact (a parameter padded, FSDP2 over one rank) the step is traced instead."""

from __future__ import annotations

import pytest
from helpers import PLANS
from test_search import _evaluated

from tpplan.analysis import analyze_memory
from tpplan.analysis.memory.dp_shards import ScaledTrace
from tpplan.analysis.dryrun import dry_run

PLAN = str(PLANS / "llama.yaml")
BF16 = "fsdp.mixed_precision={param_dtype: bfloat16, reduce_dtype: float32}"
TINY = ["train.seq_len=32", "model.kwargs.n_layers=3", "train.micro_batch_size=1"]


def _mesh(pp: int, replicate: int, shard: int, tp: int, cp: int = 1, ep: int = 1) -> str:
    return (f"mesh={{pp: {pp}, dp_replicate: {replicate}, dp_shard: {shard}, cp: {cp}, "
            f"ep: {ep}, tp: {tp}}}")


CASES = {  # name: (plan, world, overrides, the variants' --set lines)
    # HSDP at three dp_shard, bf16 mixed precision, 3 micro-batches traced (accumulation 6)
    "hsdp-bf16": (PLAN, 32, TINY + ["train.global_batch_size=96", BF16],
                  [[_mesh(1, 16 // s, s, 2)] for s in (2, 4, 8)]),
    # 16 blocks under full checkpointing: traced at depths 4, 5 and 6, each depth's step
    # scaled (tp 4)
    "deep": (PLAN, 32, ["train.seq_len=32", "model.kwargs.n_layers=16",
                        "train.micro_batch_size=1", "train.global_batch_size=16",
                        "activation_checkpointing={mode: full}"],
             [[_mesh(1, r, 8 // r, 4)] for r in (2, 4)]),
    # selective checkpointing of every second block (tp 4)
    "selective": (PLAN, 32, TINY + ["model.kwargs.n_layers=4", "train.global_batch_size=16",
                                    "activation_checkpointing={mode: selective, every: 2}"],
                  [[_mesh(1, r, 8 // r, 4)] for r in (2, 4)]),
    # pipeline stages (first, last) under 1f1b and full checkpointing
    "pipeline": (PLAN, 32, TINY + ["model.kwargs.n_layers=4", "train.global_batch_size=32",
                                   "activation_checkpointing={mode: full}"],
                 [[_mesh(2, 8 // s, s, 2), "pipeline={schedule: 1f1b, microbatches: 4}"]
                  for s in (2, 4, 8)]),
    # context parallelism: FSDP2 shards over dp_shard × cp
    "cp": (PLAN, 32, TINY + ["train.global_batch_size=16"],
           [[_mesh(1, 8 // s, s, 2, cp=2)] for s in (2, 4, 8)]),
    # experts: their weights over efsdp (dp_shard / ep), the rest over dp_shard
    "moe": (str(PLANS / "qwen3-moe-ep-tiny.yaml"), 16,
            ["train.seq_len=32", "train.global_batch_size=16", "train.micro_batch_size=1"],
            [[_mesh(1, 16 // s, s, 1, ep=2)] for s in (4, 8)]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_step_traced_at_one_dp_shard_serves_the_others_exactly(case):
    plan, world, overrides, variants = CASES[case]
    ev, got = _analysed(plan, world, overrides, variants)
    assert ev.traces["memory_dp_scaled"] > 0, ev.traces  # the others were scaled, not traced
    if case == "hsdp-bf16":  # 3 blocks, traced whole: one step traced, two served
        assert (ev.traces["memory_steps"], ev.traces["memory_dp_scaled"]) == (1, 2), ev.traces
    _equal_to_dry_runs(plan, world, overrides, variants, got)


def _analysed(plan: str, world: int, overrides: list[str], variants: list[list[str]]):
    """``search``'s memory analysis of each variant, in turn, through one cache."""
    ev, results = _evaluated(overrides, world, variants, plan, comm=False)
    return ev, [(r.extra["memory_per_rank"], r.extra.get("pipeline")) for r in results]


def _equal_to_dry_runs(plan: str, world: int, overrides: list[str],
                       variants: list[list[str]], got: list) -> None:
    for s, (mem, pipe) in zip(variants, got):
        real = dry_run(plan, world, overrides + s, [("memory_per_rank", analyze_memory)])
        assert real.ok, real.analysis_errors
        assert mem == real.extra["memory_per_rank"], s
        assert pipe == real.extra.get("pipeline"), s


def test_a_padded_shard_or_one_rank_is_traced_not_scaled():
    """FSDP2 pads a shard whose dimension 0 the degree does not divide (and the gathered
    tensor with it): no scaling to or from there. Nor to or from FSDP2 over one rank."""
    trace = ScaledTrace({}, {}, 2, [(2, 64), (2, 48)])
    assert trace.at(2) == {}  # itself
    assert trace.at(4) is not None and trace.at(8) is not None  # 48 = 8 × 6
    assert trace.at(32) is None  # 48 rows over 32 ranks pad
    assert trace.at(1) is None and ScaledTrace({}, {}, 1, [(1, 64)]).at(2) is None
    assert ScaledTrace({}, {}, 2, []).at(4) is None  # no FSDP2: nothing scales
    # A real one: a width of 48 (and 24 rows of wk and wv) over 32 and 16 ranks pads.
    overrides = TINY + ["train.global_batch_size=64", "model.kwargs.dim=48",
                        "model.kwargs.n_heads=4", "model.kwargs.n_kv_heads=2"]
    variants = [[_mesh(1, 2, 32, 1)], [_mesh(1, 4, 16, 1)]]
    ev, got = _analysed(PLAN, 64, overrides, variants)
    assert ev.traces["memory_dp_scaled"] == 0, ev.traces
    _equal_to_dry_runs(PLAN, 64, overrides, variants, got)
