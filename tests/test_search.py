"""``tpplan search``: every layout enumerated, the ones that do not divide or fit dropped with
their reason, the cached analyses equal to uncached dry runs, and the top layout's ``--set``
lines giving ``validate`` the same memory and estimate."""

from __future__ import annotations

import copy
import dataclasses
import json

from helpers import PLANS

from tpplan.analysis import ANALYSES
from tpplan.analysis.search.candidates import Options, candidates, factorizations
from tpplan.analysis.cost.step_time import estimate_step
from tpplan.analysis.dryrun import dry_run, fake_process_group
from tpplan.analysis.memory.fit import needed
from tpplan.analysis.search.bounds import sharded_state, split_free
from tpplan.analysis.search.ranking import search
from tpplan.analysis.search.trace_cache import Evaluator
from tpplan.api import load
from tpplan.cli import main
from tpplan.plan.devices import DEVICES
from tpplan.plan.pipeline import SCHEDULES

PLAN = str(PLANS / "llama.yaml")
SMALL = ["train.seq_len=32", "train.global_batch_size=8"]


def test_every_factorization_and_option_is_enumerated():
    n = 8
    meshes = {(a, b, c, d) for a in range(1, n + 1) for b in range(1, n + 1)
              for c in range(1, n + 1) for d in range(1, 5) if a * b * c * d == n}
    assert set(factorizations(n, 4)) == meshes and len(factorizations(n, 4)) == len(meshes)
    spec = load(PLAN, SMALL).spec
    got = candidates(spec, n, Options(max_tp=4, ac_every=(2,), stages_per_rank=(2,)))
    per_schedule = len(SCHEDULES)  # one stages_per_rank each: 1, or the 2 asked (or forced)
    expected = 0
    for pp, r, s, _ in meshes:
        per_rank = 8 // (r * s)  # the global batch is 8 sequences: every dp divides it
        divs = sum(1 for k in range(1, per_rank + 1) if per_rank % k == 0)
        expected += 3 * divs * (1 if pp == 1 else per_schedule)  # none, full, selective 2
    assert len(got) == expected
    assert all(c.pp * c.dp * c.tp == n for c in got)
    # ep where the plan has an expert_parallel rule: every ep dividing dp_shard; cp where it
    # has a context_parallel section: every cp. What does not compose yet (ep or cp beside
    # pp, ep beside cp) is one candidate per mesh, for the checks to drop with their reason.
    opts = Options(max_tp=1, schedules=("1f1b",), ac_every=())
    moe = candidates(load(str(PLANS / "qwen3-moe-ep-tiny.yaml")).spec, n, opts)
    assert {(c.dp_shard, c.ep) for c in moe if c.pp == 1} == \
        {(s, e) for s in (1, 2, 4, 8) for e in (1, 2, 4, 8) if s % e == 0}
    long = candidates(load(str(PLANS / "llama-long.yaml")).spec, n, opts)
    assert {c.cp for c in long} == {1, 2, 4, 8}
    assert all(c.pp * c.dp * c.cp * c.tp == n for c in moe + long)
    assert all(len(c.sets) == 1 for c in moe + long if c.pp > 1 and c.ep * c.cp > 1)
    assert all(f"cp: {c.cp}" in c.sets[0] for c in long)


def test_what_does_not_divide_or_fit_is_dropped_with_its_reason():
    import gc

    tiny = dataclasses.replace(DEVICES["h100"], name="tiny", memory=1)  # nothing fits
    collecting = gc.get_threshold()
    data = search(PLAN, 4, tiny, SMALL + ["train.global_batch_size=2"], top=3,
                  options=Options(max_tp=2, schedules=("1f1b",)))
    assert gc.get_threshold() == collecting  # search collects less often, then as before
    reasons = {d["reason"]: d for d in data["dropped"]}
    batch = next(r for r in reasons if "not divisible by the data-parallel size" in r)
    assert any("dp_shard: 4" in s for s in reasons[batch]["example"])
    # Nothing fits: each layout is dropped on its sharded state (arithmetic) or its first
    # forward, untraced further.
    assert any("alone (arithmetic, nothing traced)" in r for r in reasons)
    assert data["ranked"] == [] and data["traces"].get("memory", 0) == 0
    counted = sum(d["count"] for d in data["dropped"]) + sum(data["not_ranked"].values())
    assert counted == data["candidates"]


def test_best_first_ranks_exactly_as_estimating_every_candidate():
    """The bounds only skip analyses: the top layouts, their order and figures are those of
    the exhaustive search, which estimates (and traces) every candidate. Also on a device
    that about two thirds of the layouts do not fit, where the memory lower bounds (the first
    forward, the part no data-parallel split changes) drop layouts untraced. (At half, the
    step time with the non-GEMM term first reaches layouts whose peak is past their first
    forward: the floor then drops none, the split-free bound does.)"""
    overrides = SMALL + ["train.global_batch_size=4", "model.kwargs.n_layers=2"]
    opts = Options(max_tp=2, schedules=("1f1b",), ac_every=())
    full = search(PLAN, 2, DEVICES["h100"], overrides, options=opts, top=3, exhaustive=True)
    fast = search(PLAN, 2, DEVICES["h100"], overrides, options=opts, top=3)
    assert fast["ranked"] == full["ranked"][:3]
    assert len(full["ranked"]) > 3 and sum(fast["not_ranked"].values()) > 0
    assert fast["traces"]["memory"] < full["traces"]["memory"]
    needs = sorted(r["needed"] for r in full["ranked"])
    small = dataclasses.replace(DEVICES["h100"], memory=needs[len(needs) // 3])
    full = search(PLAN, 2, small, overrides, options=opts, top=3, exhaustive=True)
    fast = search(PLAN, 2, small, overrides, options=opts, top=3)
    assert fast["ranked"] == full["ranked"][:3] and len(full["ranked"]) > 3
    assert any("end of the first forward" in d["reason"] for d in fast["dropped"])


def test_best_first_is_exact_with_expert_and_context_parallelism_in_the_space():
    """ep (a MoE plan: every ep dividing dp_shard) and cp (a long-context plan: every cp)
    are enumerated and estimated, and best first still ranks exactly as the exhaustive
    search, down to the first layout with ep or cp above 1."""
    cases = [(str(PLANS / "qwen3-moe-ep-tiny.yaml"), 2, "ep",
              ["train.global_batch_size=4", "train.seq_len=32"]),
             (str(PLANS / "llama-long.yaml"), 2, "cp",
              ["train.global_batch_size=2", "train.seq_len=256", "model.kwargs.n_layers=2"])]
    for plan, max_tp, axis, sets in cases:
        opts = Options(max_tp=max_tp, schedules=(), ac_every=())
        full = search(plan, 2, DEVICES["h100"], sets, options=opts, top=1, exhaustive=True)
        degrees = [r["mesh"][axis] for r in full["ranked"]]
        assert {1, 2} <= set(degrees), (axis, degrees)
        top = next(i for i, d in enumerate(degrees) if d > 1) + 1
        fast = search(plan, 2, DEVICES["h100"], sets, options=opts, top=top)
        assert fast["ranked"] == full["ranked"][:top], axis
        assert sum(fast["not_ranked"].values()) > 0


def _comparable(result) -> tuple:
    mem = dict(result.extra["memory_per_rank"])
    mem.pop("pp_ranks", None)
    return mem, result.extra["comm_per_step"]["collectives"], result.extra.get("pipeline")


def _evaluated(overrides: list[str], world: int, sets: list[list[str]], plan: str = PLAN,
               memory: bool = True, comm: bool = True) -> tuple:
    """One :class:`Evaluator` over ``sets``, each checked, memory (unless not ``memory``)
    and communication (unless not ``comm``) analysed."""
    ev = Evaluator(plan, overrides, world)
    out = []
    with fake_process_group(world):
        for s in sets:
            r = ev.check(s)
            assert not r.errors, r.errors
            if memory:
                ev.memory(r)
            if comm:
                ev.comm(r)
            assert r.ok, r.analysis_errors
            out.append(r)
    return ev, out


def test_cached_analyses_equal_uncached_dry_runs():
    sets = [  # share traces: the same dp_shard under another dp_replicate, accumulation 4 vs 8
        ["mesh={pp: 1, dp_replicate: 1, dp_shard: 4, tp: 2}", "train.micro_batch_size=1"],
        ["mesh={pp: 1, dp_replicate: 2, dp_shard: 2, tp: 2}", "train.micro_batch_size=1"],
        ["mesh={pp: 1, dp_replicate: 2, dp_shard: 2, tp: 2}", "train.micro_batch_size=2",
         "activation_checkpointing={mode: selective, every: 2}"],
        ["mesh={pp: 2, dp_replicate: 1, dp_shard: 2, tp: 2}",
         "pipeline={schedule: 1f1b, microbatches: 4}"],
        ["mesh={pp: 2, dp_replicate: 2, dp_shard: 1, tp: 2}",  # the stages above, cached
         "pipeline={schedule: gpipe, microbatches: 4}"],
        ["mesh={pp: 2, dp_replicate: 1, dp_shard: 2, tp: 2}",
         "pipeline={schedule: gpipe, microbatches: 4}"],
        # cp: its own traces (keyed by cp), one resolution for two checkpointing modes
        ["mesh={pp: 1, dp_replicate: 1, dp_shard: 2, cp: 2, tp: 2}", "train.micro_batch_size=1"],
        ["mesh={pp: 1, dp_replicate: 1, dp_shard: 2, cp: 2, tp: 2}", "train.micro_batch_size=1",
         "activation_checkpointing={mode: full}"],
    ]
    moe = str(PLANS / "qwen3-moe-ep-tiny.yaml")  # ep: keyed by ep, at one dp_shard
    moe_sets = [[f"mesh={{pp: 1, dp_replicate: 1, dp_shard: 4, ep: {e}, tp: 1}}",
                 "train.micro_batch_size=1"] for e in (1, 2)]
    for plan, world, overrides, variants in (
            (PLAN, 8, SMALL + ["train.global_batch_size=16"], sets),
            (moe, 4, ["train.seq_len=32", "train.global_batch_size=4"], moe_sets)):
        ev, results = _evaluated(overrides, world, variants, plan)
        cached = [(_comparable(r), estimate_step(r, DEVICES["h100"]).step_time) for r in results]
        if plan == PLAN:
            # TP: the first two whole-model candidates share a trace (a pipeline's stages'
            # traces are cached by the stage analysis, not counted here).
            assert ev.traces["memory_cached"] >= 2 and ev.traces["tp_cached"] >= 1
        for s, (got, seconds) in zip(variants, cached):
            real = dry_run(plan, world, overrides + s, ANALYSES)
            assert got == _comparable(real), s
            assert seconds == estimate_step(real, DEVICES["h100"]).step_time


def test_cached_kernel_profiles_equal_uncached_traces():
    """``search``'s kernel traces (the non-GEMM term) are shared where their key says the
    trace is the same (a pipeline's stages under another schedule), and each candidate's
    term equals that of its own trace (``analyze_kernels`` as ``validate --device`` runs it),
    at several dp and tp splits."""
    from tpplan.analysis.analyses import analyze_kernels
    from tpplan.analysis.cost.non_gemm import non_gemm_term
    from tpplan.analysis.search.kernel_cache import KernelCache

    sets = [
        ["mesh={pp: 1, dp_replicate: 1, dp_shard: 4, tp: 2}", "train.micro_batch_size=1"],
        ["mesh={pp: 1, dp_replicate: 2, dp_shard: 2, tp: 2}", "train.micro_batch_size=1"],
        ["mesh={pp: 1, dp_replicate: 1, dp_shard: 8, tp: 1}", "train.micro_batch_size=2"],
        ["mesh={pp: 2, dp_replicate: 1, dp_shard: 2, tp: 2}", "pipeline={schedule: 1f1b, microbatches: 4}"],
        ["mesh={pp: 2, dp_replicate: 1, dp_shard: 2, tp: 2}",  # the stages above, cached
         "pipeline={schedule: gpipe, microbatches: 4}"],
    ]
    ev, cache, h100 = Evaluator(PLAN, SMALL + ["train.global_batch_size=16"], 8), KernelCache(), DEVICES["h100"]
    with fake_process_group(8):  # the meshes' groups: the traces' own
        for s in sets:
            r = ev.check(s)
            ev.comm(r)  # its mesh, as search's estimate has it
            cache(r)
            cached = non_gemm_term(r, h100)
            analyze_kernels(r)
            assert cached is not None and cached == non_gemm_term(r, h100), s
    assert cache.traces["kernels_cached"] >= 2 and cache.traces["kernels"] >= 5, cache.traces


def test_a_step_traced_once_for_kernels_and_memory_equals_the_two_traced_apart():
    """An exhaustive search traces each candidate's step once for its kernel count and its
    memory (``shared_steps``): both figures equal those of the two traces run apart, for a
    whole model at two dp_shard splits and for the stages of a pipeline."""
    from tpplan.analysis.analyses import analyze_kernels
    from tpplan.analysis.cost.non_gemm import non_gemm_term
    from tpplan.analysis.memory.step import shared_steps
    from tpplan.analysis.search.kernel_cache import KernelCache

    sets = [["mesh={pp: 1, dp_replicate: 1, dp_shard: 4, tp: 2}", "train.micro_batch_size=1"],
            ["mesh={pp: 1, dp_replicate: 2, dp_shard: 2, tp: 2}", "train.micro_batch_size=2"],
            ["mesh={pp: 2, dp_replicate: 1, dp_shard: 2, tp: 2}", "pipeline={schedule: 1f1b, microbatches: 4}"]]
    overrides = SMALL + ["train.global_batch_size=16", "model.kwargs.n_layers=2"]  # traced whole
    _, apart = _evaluated(overrides, 8, sets)
    ev, h100 = Evaluator(PLAN, overrides, 8), DEVICES["h100"]
    with fake_process_group(8), shared_steps() as shared:
        for s, alone in zip(sets, apart):
            r = ev.check(s)
            ev.comm(r)
            KernelCache()(r)  # the kernel count first, as search asks
            assert shared.traces, s  # its steps kept for the memory trace...
            ev.memory(r)
            assert not shared.traces, s  # ...which took them
            assert _comparable(r) == _comparable(alone), s
            counted = non_gemm_term(r, h100)
            with shared_steps(enabled=False):  # its own trace, apart
                analyze_kernels(alone)
            assert counted is not None and counted == non_gemm_term(alone, h100), s


def test_the_top_layout_validates_to_the_same_memory_and_estimate(capsys):
    small = SMALL + ["model.kwargs.n_layers=2"]
    assert main(["search", "--plan", PLAN, "--world-size", "4", "--device", "h100",
                 *sum((["--set", s] for s in small), []), "--top", "1", "--max-tp", "2",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    best = data["ranked"][0]
    assert data["constants"]["source"] == "defaults"
    argv = ["validate", "--plan", PLAN, "--world-size", "4", "--device", "h100", "--json"]
    for s in small + best["sets"]:
        argv += ["--set", s]
    assert main(argv) == 0
    v = json.loads(capsys.readouterr().out)
    assert v["memory_per_rank"]["peak"] == best["peak"]
    assert needed(best["peak"]) == best["needed"] and v["fit"]["fits"]
    assert v["step_time"]["step_time"] == best["step_time"]


def test_what_no_data_parallel_split_changes_bounds_every_split():
    """``split_free`` of one dp_replicate × dp_shard split is at most the peak of every other
    split of the layout (search drops a split on it without tracing), with and without a
    pipeline and with dp_shard 1 (no FSDP sharding) among them."""
    shared = 0
    layouts = {1: (["train.micro_batch_size=1"], [(1, 4), (2, 2), (4, 1)]),
               2: (["pipeline={schedule: 1f1b, microbatches: 4}"], [(1, 2), (2, 1)])}
    for pp, (tail, splits) in layouts.items():
        sets = [[f"mesh={{pp: {pp}, dp_replicate: {r}, dp_shard: {s}, tp: 2}}", *tail]
                for r, s in splits]
        ev, results = _evaluated(SMALL + ["train.global_batch_size=16"], 8, sets)
        mems = [r.extra["memory_per_rank"] for r in results]
        assert len({m["peak"] for m in mems}) == len(mems)  # the splits differ...
        # ...and each split's sharded state, from arithmetic, is its traced parameters and
        # AdamW moments (less AdamW's step counters): with any other split's split-free
        # part, a bound of its peak.
        for r, m in zip(results, mems):
            state = sharded_state(r, ev.fsdp_units(r))
            if pp == 1:
                held = m["at_peak"]["parameters"] + m["at_peak"]["optimizer"]
                assert 0 < held - state <= 8 * len(list(r.model.parameters())), (held, state)
            assert max(split_free(o) for o in mems) + state <= m["peak"]
        moments: dict[str, set] = {}  # ...but not in these parts, at the same moment
        for m in mems:
            moments.setdefault(m["peak_at"], set()).add(split_free(m))
        assert all(len(v) == 1 for v in moments.values())
        shared += len(mems) - len(moments)
    assert shared  # some splits do peak at the same moment


def test_deep_stages_of_any_pp_share_their_shallow_traces():
    """Stages of 32 and 16 identical blocks (pp 2 and pp 4) are each traced at the same three
    shallow depths: the second pp reuses the first's traces. Stages of 8 blocks (pp 8),
    which alone are traced whole, take them too once they are kept, as the first forwards
    of 4-block stages (pp 16) take the one run (4 blocks) a deeper stage's kept.
    Each equals an uncached run, which traces every block of the short stages."""
    from tpplan.analysis.memory.floor import memory_floor

    base = ["model.kwargs.n_layers=64", "train.seq_len=32", "train.global_batch_size=64",
            "activation_checkpointing={mode: none}"]
    # One micro-batch of one sequence, 3 of them traced, dp_shard 2 under dp_replicate.
    sets = [[f"mesh={{pp: {pp}, dp_replicate: {16 // pp}, dp_shard: 2, tp: 2}}",
             f"pipeline={{schedule: 1f1b, microbatches: {2 * pp}}}"] for pp in (2, 4, 8)]
    ev, results = _evaluated(base, 64, sets)
    assert all(r.extra["memory_per_rank"]["traced"]["depths"] == [4, 5, 6] for r in results)
    assert ev.traces["memory_from_shallow"] >= 2
    # The second and third are the ones served from the first's traces.
    for s, r in zip(sets[1:], results[1:]):
        real = dry_run(PLAN, 64, base + s, ANALYSES)
        if s is sets[2]:
            assert real.extra["memory_per_rank"]["traced"]["depths"] == []  # every block
        got, want = _comparable(r), _comparable(real)
        assert {k: v for k, v in got[0].items() if k != "traced"} == \
            {k: v for k, v in want[0].items() if k != "traced"} and got[1:] == want[1:], s
    floors = [sets[0], ["mesh={pp: 16, dp_replicate: 2, dp_shard: 1, tp: 2}",
                        "pipeline={schedule: 1f1b, microbatches: 32}"]]
    ev = Evaluator(PLAN, base, 64)
    with fake_process_group(64):
        for s in floors:  # micro-batches of one sequence each: one key
            r = ev.check(s)
            before = ev.traces["first_forward_from_shallow"]
            assert ev.floor(r) == memory_floor(r), s
        assert ev.traces["first_forward_from_shallow"] == before + 2  # pp 16's first and last


def test_a_pipelines_interior_periods_bound_each_pp_ranks_tp_rows():
    """The whole model's traced period, times each stage's periods with a whole period on
    each side (``interior_rows``: what ``search`` bounds a pipeline layout by before its
    stages are traced), is at most every pp rank's own TP rows (count and wire bytes of
    each kind), above nothing where a stage has such periods, and the bound with it at
    most the layout's estimate; under checkpointing, the period traced without it too:
    stages of 3 to 6 blocks, one or two stages per rank, checkpointing none, full and
    every second block, two head layouts."""
    from tpplan.analysis import fsdp_rows
    from tpplan.analysis.cost.step_time import step_time_bound
    from tpplan.analysis.comm.stage_bound import interior_rows
    from tpplan.analysis.memory.stages import pipeline_schedule

    pipes = [(2, "pipeline={schedule: 1f1b, microbatches: 8}"),  # 6 blocks a stage
             (2, "pipeline={schedule: interleaved_1f1b, microbatches: 8, stages_per_rank: 2}"),
             (4, "pipeline={schedule: 1f1b, microbatches: 16}")]  # 3 blocks a stage
    acs = ["{mode: none}", "{mode: full}", "{mode: selective, every: 2}"]
    heads = [[], ["model.kwargs.n_heads=4", "model.kwargs.n_kv_heads=2"]]
    checked = bounded = 0
    for extra in heads:
        ev = Evaluator(PLAN, SMALL + ["train.global_batch_size=16", "model.kwargs.n_layers=12",
                                      *extra], 8)
        with fake_process_group(8):
            for ac in acs:
                whole = ev.check(["mesh={pp: 1, dp_replicate: 2, dp_shard: 2, tp: 2}",
                                  f"activation_checkpointing={ac}", "train.micro_batch_size=1"])
                assert interior_rows(whole, ev.tp_traces, ev.stages) is None  # no pipeline
                for pp, pipe in pipes:
                    sets = [f"mesh={{pp: {pp}, dp_replicate: 1, dp_shard: {4 // pp}, tp: 2}}",
                            f"activation_checkpointing={ac}", pipe]
                    r = ev.check(sets)
                    assert r.step.micro_batch == 1, sets
                    if pipe is pipes[0][1]:  # before the whole model's trace: no bound
                        assert interior_rows(r, ev.tp_traces, ev.stages) is None
                    ev.comm(whole)
                    inner = interior_rows(r, ev.tp_traces, ev.stages)
                    # Without checkpointing's period (traced first): recomputation only adds.
                    plain = interior_rows(r, ev.tp_traces, ev.stages, True)
                    assert (plain == inner) == (ac == acs[0]) and plain, sets
                    r.extra["pipeline"] = pipeline_schedule(r.plan.spec, r.resolution.dims,
                                                            r.resolution.pipeline)
                    ev.comm(r)
                    assert r.ok, r.analysis_errors
                    ranks = r.extra["comm_per_step"]["pp_ranks"]
                    assert len(inner) == len(ranks) == pp
                    for mine, theirs, rank in zip(inner, plain, ranks):
                        own = {(x["source"], x["kind"], x["mesh_dim"]): x
                               for x in rank["collectives"]}
                        for x in mine + theirs:
                            y = own[(x["source"], x["kind"], x["mesh_dim"])]
                            assert x["count"] <= y["count"] and \
                                x["wire_bytes"] <= y["wire_bytes"], (sets, x, y)
                        blocks = [len(s.blocks) for s in r.resolution.pipeline.of_rank(
                            rank["pp_rank"])]
                        every = 2 if "every" in ac else 1
                        assert bool(mine) == any(b // every > 2 for b in blocks), (sets, blocks)
                        bounded += bool(mine)
                    step = estimate_step(r, DEVICES["h100"]).step_time
                    rows = fsdp_rows(r, ev.stages)
                    alone = step_time_bound(r, DEVICES["h100"], fsdp=rows)
                    for traced in (inner, plain):
                        tighter = step_time_bound(r, DEVICES["h100"], fsdp=rows, traced=traced)
                        assert alone <= tighter <= step, sets
                    checked += 1
    assert checked == 18 and bounded >= 20


LORA = ('lora={targets: ["layers.*.attention.{wq,wk,wv,wo}", "layers.*.feed_forward.{w1,w2,w3}"], '
        'rank: 8, modules_to_save: [output]}')


def test_a_plans_lora_is_taken_as_given():
    """With a ``lora`` section every candidate carries it: the cached analyses (memory with
    the base frozen, FSDP reducing the adapters only, the TP trace with them) and the
    checkpoint size equal uncached dry runs of the LoRA plan, whose gradients and optimizer
    state are those of the adapters and the head, not the model's."""
    sets = [["mesh={pp: 1, dp_replicate: 1, dp_shard: 4, tp: 2}", "train.micro_batch_size=1"],
            ["mesh={pp: 2, dp_replicate: 1, dp_shard: 2, tp: 2}",
             "pipeline={schedule: 1f1b, microbatches: 4}"]]
    overrides = SMALL + ["train.global_batch_size=16", LORA]
    ev, results = _evaluated(overrides, 8, sets)
    for s, r in zip(sets, results):
        real = dry_run(PLAN, 8, overrides + s, ANALYSES)
        assert _comparable(r) == _comparable(real), s
        assert r.checkpoint_bytes == real.checkpoint_bytes
        full = dry_run(PLAN, 8, overrides[:-1] + s, ANALYSES)
        for part in ("gradients", "optimizer"):
            assert real.extra["memory_per_rank"][part] < full.extra["memory_per_rank"][part] / 2
        assert real.checkpoint_bytes < full.checkpoint_bytes / 2


def test_stages_with_frozen_blocks_in_one_stage_equal_uncached():
    """Deep stages (16 blocks each) where ``freeze`` takes two blocks of the first stage:
    its blocks are not alike (traced whole), the second stage's are (shallow traces). The
    cache reads each stage in place (its blocks, its keys, whether its blocks are alike,
    without a copy); the second schedule, served from the first's stages, has the memory,
    communication and first-forward floor of uncached runs."""
    from tpplan.analysis.memory.floor import memory_floor
    from tpplan.models import build_model

    base = ["model.kwargs.n_layers=32", "train.seq_len=32", "train.global_batch_size=16",
            "activation_checkpointing={mode: none}", 'freeze=["layers.{3,4}"]']
    sets = [["mesh={pp: 2, dp_replicate: 1, dp_shard: 2, tp: 2}", f"pipeline={{schedule: {s}, "
             "microbatches: 4}"] for s in ("1f1b", "gpipe")]
    ev = Evaluator(PLAN, base, 8)
    floors = []
    with fake_process_group(8):
        for s in sets:
            r = ev.check(s)
            floors.append(ev.floor(r))
            ev.memory(r)
            ev.comm(r)
        # The second layout's floor, from the first's stages, against one run afresh on a
        # model of its own.
        fresh = copy.copy(r)
        fresh.model = build_model(r.plan.spec.model, "meta")
        assert floors[-1] == memory_floor(fresh)
    assert ev.traces["memory_cached"] >= 1 and ev.traces["stage_tp_cached"] >= 1, ev.traces
    assert ev.traces["first_forward_stages_cached"] == 1, ev.traces
    real = dry_run(PLAN, 8, base + sets[1], ANALYSES)  # the one served from the cache
    assert r.ok and _comparable(r) == _comparable(real)
    assert 0 < floors[-1] <= real.extra["memory_per_rank"]["peak"]


def test_the_first_forward_bounds_the_traced_peak():
    """``memory_floor`` (one micro-batch's activations from the first forward, the sharded
    state and the unsharded gradients kept between micro-batches from shapes; a pipeline
    rank's in-flight micro-batches) is at most the traced peak, for every layout tried:
    tp, micro-batch, accumulation, each checkpointing mode, data-parallel splits (dp_shard 1
    among them: one probe serves every split), pipeline schedules with one and two stages
    per rank, expert and context parallelism. Its parts are what the trace holds: every
    micro-batch's forward leaves the same activations (the first forward run alone too,
    without the whole trace's warm-up, on every layout without a pipeline), and
    the sharded state and FSDP2's kept gradients are the arithmetic's. A pipeline's bound
    holds rank by rank (``memory_floor``'s ``pp_ranks``, which ``search`` traces first)."""
    from tpplan.analysis import model_blocks
    from tpplan.analysis.memory.floor import memory_floor, state_elements
    from tpplan.analysis.memory.per_rank import first_forward
    from tpplan.analysis.memory.step import trace_step
    from tpplan.models import build_model

    base = SMALL + ["train.global_batch_size=16", "model.kwargs.n_layers=8"]  # 8 > 6 blocks:
    cases = [(PLAN, 8, base, [  # the first forward is run at 4 blocks and extrapolated
        ["mesh={pp: 1, dp_replicate: 1, dp_shard: 4, tp: 2}", "train.micro_batch_size=1"],
        ["mesh={pp: 1, dp_replicate: 4, dp_shard: 1, tp: 2}", "train.micro_batch_size=1"],
        ["mesh={pp: 1, dp_replicate: 2, dp_shard: 2, tp: 2}", "train.micro_batch_size=2",
         "activation_checkpointing={mode: selective, every: 2}"],
        ["mesh={pp: 1, dp_replicate: 1, dp_shard: 8, tp: 1}", "train.micro_batch_size=2",
         "activation_checkpointing={mode: full}"],
        ["mesh={pp: 2, dp_replicate: 1, dp_shard: 2, tp: 2}",
         "pipeline={schedule: 1f1b, microbatches: 4}"],
        ["mesh={pp: 2, dp_replicate: 2, dp_shard: 1, tp: 2}",  # the stages above, cached
         "pipeline={schedule: gpipe, microbatches: 4}"],
        ["mesh={pp: 2, dp_replicate: 2, dp_shard: 1, tp: 2}",
         "pipeline={schedule: interleaved_1f1b, microbatches: 4, stages_per_rank: 2}"],
        ["mesh={pp: 2, dp_replicate: 1, dp_shard: 4, tp: 1}",
         "pipeline={schedule: zbv, microbatches: 2, stages_per_rank: 2}",
         "activation_checkpointing={mode: full}"],
        ["mesh={pp: 1, dp_replicate: 1, dp_shard: 2, cp: 2, tp: 2}", "train.micro_batch_size=1"]]),
        (str(PLANS / "qwen3-moe-ep-tiny.yaml"), 4, ["train.seq_len=32", "train.global_batch_size=8"],
         [[f"mesh={{pp: 1, dp_replicate: 1, dp_shard: 4, ep: {e}, tp: 1}}",
           "train.micro_batch_size=1"] for e in (2, 4)])]
    for plan, world, overrides, variants in cases:
        ev = Evaluator(plan, overrides, world)
        with fake_process_group(world):
            for s in variants:
                r = ev.check(s)
                floor = ev.floor(r)
                # The cache's answer (a pipeline's stages kept across schedules and their
                # micro-batches) is the floor run afresh, uncached.
                assert floor == memory_floor(r), s
                ev.memory(r)
                mem = r.extra["memory_per_rank"]
                assert 0.25 * mem["peak"] < floor <= mem["peak"], (s, floor, mem["peak"])
                if r.plan.spec.pipeline is None:  # the probe, no warm-up: the traced step's
                    blocks, n = model_blocks(r)
                    probe = first_forward(r.plan.spec, r.mesh, lambda m=r.plan.spec.model:
                                          build_model(m, "meta"), r.step, n, blocks)
                    assert probe == mem["activations"], (s, probe, mem["activations"])
                if r.plan.spec.pipeline is not None:  # each pp rank's bound under its peak
                    ranks = r.extra["memory_floor"]["pp_ranks"]
                    assert max(ranks.values()) == floor and len(ranks) == len(mem["pp_ranks"])
                    assert all(ranks[m["pp_rank"]] <= m["peak"] for m in mem["pp_ranks"])
            if plan == PLAN:  # the parts, in the trace itself: 4 micro-batches (3 traced)
                assert ev.traces["first_forward_cached"] >= 1  # one probe, two splits
                assert ev.traces["first_forward_stages_cached"] == 1  # gpipe: 1f1b's stages
                r = ev.check(variants[0])
                spec, mesh = r.plan.spec, ev._mesh(r.resolution.dims)
                args = (spec, mesh, lambda m=spec.model: build_model(m, "meta"), r.step)
                whole, first = trace_step(*args), trace_step(*args, first_forward=True)
                end = {m: whole[f"{m}/mark/end_forward"] for m in ("first", "middle", "last")}
                assert len({m.parts["activations"] for m in end.values()} |
                           {first["first/mark/end_forward"].parts["activations"]}) == 1
                sharded, trained, unsharded = state_elements(r)
                kept = end["last"].parts["accumulated_gradients"]  # fp32, and a few others
                assert 0 <= kept - 4 * unsharded < 0.05 * kept
                held = end["last"].parts["parameters"] + end["last"].parts["optimizer"]
                assert 0 <= held - 4 * (sharded + 2 * trained) < 0.01 * held


def test_a_candidate_whose_ep_borrows_tp_after_one_without_ep_counts_as_alone(tmp_path, capsys):
    """With its MoE blocks on the sequence shard, ep 2 borrows tp 2's ranks: ep's group
    holds the same ranks as tp's. After a candidate on a tp mesh equal to its own (DTensor's
    caches, kept across candidates, hand on that mesh and its group, which a lookup by
    ranks cannot tell from ep's: it counted other collectives), the evaluator's figures are
    a fresh dry run's."""
    import sys

    from helpers import ROOT, run_main

    sys.path.insert(0, str(ROOT / "scripts"))
    import sweep_hf

    config = tmp_path / "qwen3_moe.json"
    config.write_text(json.dumps(sweep_hf.tiny_config("qwen3_moe")))
    plan = tmp_path / "sp-ep.yaml"
    rc, out = run_main(capsys, "import-hf", config, "--sequence-parallel", "--ep", "2",
                       "-o", plan)
    assert rc == 0, out
    overrides = ["train.seq_len=16", "train.global_batch_size=4"]
    sets = [["mesh={pp: 1, dp_replicate: 1, dp_shard: 2, ep: 1, tp: 2}"],
            ["mesh={pp: 1, dp_replicate: 1, dp_shard: 2, ep: 2, tp: 2}"]]
    _, results = _evaluated(overrides, 4, sets, str(plan), memory=False)
    assert results[1].resolution.dims.ep_borrows_tp
    for s, got in zip(sets, results):
        real = dry_run(str(plan), 4, overrides + s, ANALYSES)
        assert got.extra["comm_per_step"]["collectives"] == \
            real.extra["comm_per_step"]["collectives"], s
