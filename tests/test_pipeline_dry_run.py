"""Promises of ``tpplan validate`` for pipeline plans: the schedule's bubble and in-flight
micro-batches (from torch's own orders) agree with the papers' closed forms, the
point-to-point traffic is what a real gloo run sends, and the activations predicted per
stage for 1F1B are what a real run saves for backward."""

from __future__ import annotations

import json
import weakref
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import PLANS, TEST_PLANS

import tpplan
from tpplan.analysis import ANALYSES
from tpplan.analysis.dryrun import dry_run
from tpplan.analysis.cost.schedule import (TIME, bubble_fraction, fsdp_order, in_flight,
                                      schedule_actions, torch_table)
from tpplan.parallel.runtime import as_spawned_rank, spawn

PLAN = str(PLANS / "llama-3d.yaml")
# pp 2 × tp 2 on 4 processes, 1F1B over 4 micro-batches of 2 × 32 tokens. No FSDP (dp is 1)
# and no checkpointing, so what autograd saves is all the activations there are.
SMALL = ["mesh.tp=2", "mesh.pp=2", "fsdp=null", "activation_checkpointing=null",
         "train.seq_len=32", "train.global_batch_size=8", "pipeline.schedule=1f1b",
         "pipeline.microbatches=4"]
SMALL_NO_PP = ["train.seq_len=32", "train.global_batch_size=8"]
# pp 2 × dp_shard 2 × tp 2 on 8 processes: the plan's FSDP2 and selective checkpointing too.
SMALL_3D = ["mesh.tp=2", "mesh.pp=2", "train.seq_len=32", "train.global_batch_size=16",
            "pipeline.schedule=1f1b", "pipeline.microbatches=4"]


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 12), (8, 16)])
def test_bubble_and_in_flight_follow_the_closed_forms(pp, m):
    for name in ("gpipe", "1f1b"):
        actions = schedule_actions(name, pp, 1, m)
        assert bubble_fraction(actions, m) == pytest.approx((pp - 1) / m)
        expected = {s: m if name == "gpipe" else min(m, pp - s) for s in range(pp)}
        assert in_flight(actions) == expected
    for name in ("interleaved_1f1b", "looped_bfs"):  # Narayanan et al. 2021: (p-1)/(v·m)
        actions = schedule_actions(name, pp, 2, m)
        assert bubble_fraction(actions, m) == pytest.approx((pp - 1) / (2 * m))
    for name in ("interleaved_zero_bubble", "zbv"):  # less than interleaved 1F1B's
        actions = schedule_actions(name, pp, 2, m)
        assert bubble_fraction(actions, m) < (pp - 1) / (2 * m)
        assert all(1 <= k <= m for k in in_flight(actions).values())


@pytest.mark.parametrize("name", ["interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble",
                                  "zbv", "dualpipev"])
def test_fsdp_order_unshards_and_reshards_where_torchs_lowering_does(name):
    """``fsdp_order``'s UNSHARD and RESHARD of whole stages, among the computations, are
    exactly where torch's runtime lowering (``_add_unshard_reshard``) puts them."""
    from torch.distributed.pipelining.schedules import _add_unshard_reshard

    def flat(a):  # an overlapped forward+backward (DualPipeV) as its two computations
        return [x for s in a.sub_actions for x in flat(s)] if a.sub_actions else [a]

    for pp, v, m in [(2, 1, 4), (2, 2, 4), (2, 2, 8), (4, 2, 8), (4, 3, 12), (4, 4, 8),
                     (8, 2, 16), (4, 2, 5)]:
        try:
            table = torch_table(name, pp, v, m)
        except Exception:  # noqa: BLE001 - degrees this schedule does not take
            continue
        order = fsdp_order(name, pp, v, m)
        for rank, acts in table.items():
            expected = []
            for a in _add_unshard_reshard(list(acts)):
                for x in flat(a):
                    kind = x.computation_type.value
                    if kind in ("UNSHARD", "RESHARD"):
                        expected.append((kind[0], x.stage_index, -1))
                    elif kind in TIME:
                        expected.append((kind, x.stage_index, x.microbatch_index))
            assert [tuple(a) for a in order[rank]] == expected, (pp, v, m, rank)


class _Recorder:
    """Every collective a process issues, as (mesh dimension, kind, bytes of its buffer): a
    dispatch mode of its own, written independently of tpplan's recorder (the same idea as
    ``memory_measure``'s). Groups are named by the mesh dimension whose ranks they hold."""

    KINDS = {"all_reduce": "all_reduce", "allreduce_": "all_reduce",
             "all_gather_into_tensor": "all_gather", "_allgather_base_": "all_gather",
             "allgather_into_tensor_coalesced_": "all_gather",
             "reduce_scatter_tensor": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
             "reduce_scatter_tensor_coalesced_": "reduce_scatter",
             "all_to_all_single": "all_to_all", "alltoall_base_": "all_to_all"}

    def __init__(self, mesh):
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _resolve_process_group
        from torch.utils._python_dispatch import TorchDispatchMode

        dims = {tuple(sorted(mesh[d].mesh.flatten().tolist())): d
                for d in ("pp", "dp_replicate", "dp_shard", "tp") if mesh[d].size() > 1}
        rows = self.rows = []
        kinds = self.KINDS

        def dim(group) -> str:
            pg = dist.ProcessGroup.unbox(group) if isinstance(group, torch.ScriptObject) else \
                _resolve_process_group(group)
            desc = getattr(pg, "group_desc", "")
            if desc in ("mesh_cp", "mesh_dp_shard_cp", "mesh_ep", "mesh_efsdp"):
                return desc.removeprefix("mesh_")  # ranks alone cannot tell them apart
            ranks = tuple(sorted(dist.get_process_group_ranks(pg)))
            return dims.get(ranks, str(ranks))

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                from torch.distributed.tensor import DTensor

                if any(issubclass(t, DTensor) for t in types):
                    return NotImplemented  # see the collectives DTensor issues inside its ops
                out = func(*args, **(kwargs or {}))
                name = func._overloadpacket.__name__
                if name in kinds and func.namespace in ("_c10d_functional", "c10d",
                                                        "_c10d_functional_autograd"):
                    if func.namespace == "c10d":  # FSDP2: (output, input, process group, ...)
                        pg = next(a for a in args if isinstance(a, torch.ScriptObject))
                        t = args[1] if "reduce_scatter" in name else args[0]
                        nbytes = sum(x.numel() * x.element_size() for x in
                                     (t if isinstance(t, list) else [t]))
                    else:  # DTensor: (input, ..., group name); all-gathers get a shard
                        pg, t = args[-1], args[0]
                        size = args[-2] if name == "all_gather_into_tensor" else 1
                        nbytes = t.numel() * t.element_size() * size
                    rows.append((dim(pg), kinds[name], nbytes))
                return out

        self.mode = Mode()


def _worker(rank: int, world: int, port: int, overrides: list[str], out: str,
            plan_path: str = PLAN) -> None:
    """Two steps of the plan's schedule on real CPU tensors (under cp each rank's part of
    the sequence, its positions to every stage, as the trainer gives them); in the second,
    every tensor the schedule sends or receives, and the bytes saved for backward alive at
    once, at their most (each storage once)."""
    as_spawned_rank(rank, world, port)
    import warnings

    import torch.distributed as dist
    import torch.nn.functional as F

    import tpplan
    from tpplan.models import build_model

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    from tpplan.parallel.context.sequence import shard_batch

    plan = tpplan.load(plan_path, overrides)
    mesh = plan.build_mesh("cpu")
    p2p: list[tuple[str, int]] = []

    def recording(get_ops):  # every send and receive the schedule asks a stage for
        def ops(*args, **kwargs):
            out = get_ops(*args, **kwargs)
            p2p.extend((op.op.__name__, op.tensor.numel() * op.tensor.element_size())
                       for op in out)
            return out
        return ops

    try:
        torch.manual_seed(0)
        model = build_model(plan.model, device="cpu")
        pipe = plan.apply_pipeline(model, mesh, lambda logits, y: F.cross_entropy(
            logits.flatten(0, 1).float(), y.flatten()), device="cpu")
        # Parameters and buffers (the rotary table) are saved by some ops, but are not
        # activations.
        known = {(p.to_local() if hasattr(p, "to_local") else p).untyped_storage()._cdata
                 for m in pipe.modules for p in [*m.parameters(), *m.buffers()]}
        saved: dict[int, weakref.ref] = {}
        most = [0]

        def pack(t):
            local = t.to_local() if hasattr(t, "to_local") else t
            st = local.untyped_storage()
            if st._cdata not in known:
                saved[st._cdata] = weakref.ref(st)
            live = sum(s.nbytes() for s in (r() for r in saved.values()) if s is not None)
            most[0] = max(most[0], live)
            return t

        for stage in pipe.stages:
            for name in ("get_fwd_send_ops", "get_bwd_send_ops", "get_fwd_recv_ops",
                         "get_bwd_recv_ops"):
                setattr(stage, name, recording(getattr(stage, name)))
        tokens = torch.randint(0, 256, (plan.step_shape(world).global_batch // mesh[
            "dp_shard"].size(), plan.train.seq_len + 1))
        inputs, targets, kwargs = shard_batch(pipe.modules[0], tokens[:, :-1], tokens[:, 1:])
        with plan.loss_context():  # the first step also builds the stages' buffers
            pipe.step(inputs, target=targets, losses=[], **kwargs)
        p2p.clear()
        rec = _Recorder(mesh)
        with rec.mode, plan.loss_context(), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            pipe.step(inputs, target=targets, losses=[], **kwargs)
            # What the optimizer needs before it can use a gradient: its parameter's
            # placement (a sequence-parallel norm's partial gradient summed over tp). FSDP2
            # does this itself before its reduce-scatter; without FSDP2 it is done here.
            for p in pipe.parameters():
                g = p.grad
                if hasattr(g, "placements") and g.placements != p.placements:
                    p.grad = g.redistribute(p.device_mesh, p.placements)
        found = {"p2p": p2p, "saved": most[0], "collectives": rec.rows,
                 "pp_rank": mesh["pp"].get_local_rank()}
        if mesh["tp"].get_local_rank() == 0 and mesh["dp_shard"].get_local_rank() == 0:
            (Path(out) / f"pp{mesh['pp'].get_local_rank()}.json").write_text(json.dumps(found))
        # every rank's too: routed tokens make each rank's all-to-all bytes its own
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(found))
    finally:
        dist.destroy_process_group()


def _dry_run(world: int, overrides: list[str], memory_only: bool = False) -> dict:
    analyses = [a for a in ANALYSES if a[0] == "memory_per_rank"] if memory_only else ANALYSES
    result = dry_run(PLAN, world, overrides, analyses, apply=not memory_only)
    assert result.ok, (result.errors, result.analysis_errors)
    return json.loads(json.dumps(result.extra))


def test_a_pipeline_dry_run_after_another_in_the_same_process():
    """DTensor caches sharding decisions by mesh, and meshes of the same shape compare equal
    across process groups: the dry run empties those caches when its fake group ends, so a
    second run in one process (what ``--device``'s checked changes do) traces its own."""
    plain = dry_run(str(PLANS / "llama.yaml"), 4, SMALL_NO_PP, ANALYSES)
    assert plain.ok, (plain.errors, plain.analysis_errors)
    piped = dry_run(PLAN, 4, SMALL, ANALYSES)
    assert piped.ok, (piped.errors, piped.analysis_errors)
    again = dry_run(str(PLANS / "llama.yaml"), 4, SMALL_NO_PP, ANALYSES)
    assert again.ok and again.extra["comm_per_step"] == plain.extra["comm_per_step"]


def test_p2p_traffic_and_1f1b_activations_match_a_real_gloo_run(tmp_path):
    predicted = _dry_run(4, SMALL)
    spawn(_worker, 4, SMALL, str(tmp_path))
    ranks = {r["pp_rank"]: r for r in predicted["memory_per_rank"]["pp_ranks"]}
    for p2p in _assert_p2p(predicted, tmp_path):
        real = json.loads((tmp_path / f"pp{p2p['pp_rank']}.json").read_text())
        # 1F1B: stage s keeps min(m, p - s) micro-batches' activations (Narayanan et al.)
        mine = ranks[p2p["pp_rank"]]
        assert mine["stages"][0]["in_flight"] == min(4, 2 - p2p["pp_rank"])
        assert mine["activations"] == pytest.approx(real["saved"], rel=0.15)
    comm = {(r["source"], r["kind"]): r for r in predicted["comm_per_step"]["collectives"]}
    assert comm[("pp", "send")]["count"] == 4
    _assert_collectives_per_rank(predicted, tmp_path)


def _assert_p2p(predicted: dict, out: Path) -> list[dict]:
    """Each pp rank's sends and receives in one real step: as many as the dry run predicts,
    each of the predicted size (the activation a stage passes on); the predicted rows."""
    rows = predicted["pipeline"]["p2p"]
    for p2p in rows:
        real = json.loads((out / f"pp{p2p['pp_rank']}.json").read_text())
        sends = [b for op, b in real["p2p"] if op == "isend"]
        recvs = [b for op, b in real["p2p"] if op == "irecv"]
        assert len(sends) == p2p["send_forward"] + p2p["send_backward"]
        assert len(recvs) == p2p["recv_forward"] + p2p["recv_backward"]
        assert sum(sends) == len(sends) * p2p["bytes_each"]
        assert sum(recvs) == len(recvs) * p2p["bytes_each"]
    return rows


def test_context_parallel_under_pipeline_stages_matches_a_real_gloo_run(tmp_path):
    """pp 2 × cp 2 (ring, FSDP2 over dp_shard × cp): each stage passes on its rank's part of
    the sequence (half the bytes of pp alone), and each pp rank's cp collectives (K/V
    all-gathers, dK/dV reduce-scatters; the stages' micro-batches of plain positions take the
    mask-free path as without stages) and FSDP2's equal the dry
    run's, counts and bytes."""
    plan = str(PLANS / "llama-fsdp.yaml")
    overrides = ["model.kwargs={n_layers: 2}", "mesh.pp=2", "mesh.cp=2", "train.seq_len=32",
                 "train.global_batch_size=4", "pipeline={schedule: 1f1b, microbatches: 2}"]
    result = dry_run(plan, 4, overrides, ANALYSES)
    assert result.ok, (result.errors, result.analysis_errors)
    predicted = json.loads(json.dumps(result.extra))
    spawn(_worker, 4, overrides, str(tmp_path), plan)
    rows = _assert_p2p(predicted, tmp_path)
    assert rows[0]["bytes_each"] == 2 * 16 * 128 * 4  # 2 sequences × 16 of 32 tokens × dim, fp32
    _assert_collectives_per_rank(predicted, tmp_path)
    for r in predicted["comm_per_step"]["pp_ranks"]:
        assert {c["mesh_dim"] for c in r["collectives"]} == {"cp", "dp_shard_cp", "pp"}


def _assert_collectives_per_rank(predicted: dict, out: Path) -> None:
    """Each pp rank's TP and FSDP collectives in one real step: counts and bytes per (mesh
    dimension, kind) equal what the dry run predicts for that rank's stages."""
    ranks = predicted["comm_per_step"]["pp_ranks"]
    assert len(ranks) == 2
    for r in ranks:
        real = json.loads((out / f"pp{r['pp_rank']}.json").read_text())["collectives"]
        count, nbytes = Counter(), Counter()
        for dim, kind, b in real:
            count[(dim, kind)] += 1
            nbytes[(dim, kind)] += b
        rows = [c for c in r["collectives"] if c["source"] != "pp"]
        assert {(c["mesh_dim"], c["kind"]): c["count"] for c in rows} == count, r["pp_rank"]
        assert {(c["mesh_dim"], c["kind"]): c["bytes"] for c in rows} == nbytes, r["pp_rank"]


def test_experts_all_to_all_under_pipeline_stages_matches_a_real_gloo_run(tmp_path):
    """pp 2 × ep 2 on the tiny Qwen3-MoE (one MoE block per stage, 1F1B over 2 micro-batches,
    routed for real): each rank's all-to-alls on ep, FSDP2's collectives and the stages' p2p
    are the dry run's for its pp rank, counts per rank. Bytes per rank too, but for the
    all-to-all: the combine sends back what arrived, which depends on the routing, so the
    ep ranks of a stage together send ep × the dry run's balanced figure (each dispatch sends
    its own tokens × top-k rows whatever the routing). The "experts' all-to-all" line is
    a pp rank's own stages', as every per-rank figure."""
    plan = str(PLANS / "qwen3-moe-ep-tiny.yaml")
    overrides = ["mesh.ep=2", "mesh.pp=2", "train.seq_len=32", "train.global_batch_size=4",
                 "pipeline={schedule: 1f1b, microbatches: 2}"]
    result = dry_run(plan, 4, overrides, ANALYSES)
    assert result.ok, (result.errors, result.analysis_errors)
    predicted = json.loads(json.dumps(result.extra))
    spawn(_worker, 4, overrides, str(tmp_path), plan)
    _assert_p2p(predicted, tmp_path)
    comm = predicted["comm_per_step"]
    line = comm["ep_all_to_all"]
    for r in comm["pp_ranks"]:
        rows = {(c["mesh_dim"], c["kind"]): c for c in r["collectives"] if c["source"] != "pp"}
        a2a = rows[("ep", "all_to_all")]
        assert (a2a["count"], a2a["bytes"]) == (line["count"], line["balanced_bytes"])
        sent = 0
        for f in tmp_path.glob("rank*.json"):
            real = json.loads(f.read_text())
            if real["pp_rank"] != r["pp_rank"]:
                continue
            count, nbytes = Counter(), Counter()
            for dim, kind, b in real["collectives"]:
                count[(dim, kind)] += 1
                nbytes[(dim, kind)] += b
            sent += nbytes.pop(("ep", "all_to_all"))
            assert {k: c["count"] for k, c in rows.items()} == count, (r, real)
            assert {k: c["bytes"] for k, c in rows.items() if k[1] != "all_to_all"} == nbytes
        assert sent == 2 * a2a["bytes"], (sent, a2a)


def test_tp_and_fsdp_collectives_of_each_stage_match_a_real_8_process_run(tmp_path):
    """pp 2 × dp_shard 2 × tp 2, FSDP2 and selective checkpointing: each pp rank all-gathers
    and reduce-scatters only its own stage's units, and FSDP2 inside the schedule gathers a
    unit m + 1 times per step (1F1B), reduce-scatters it once."""
    predicted = _dry_run(8, SMALL_3D)
    assert predicted["comm_per_step"]["grad_accum"] == 4
    spawn(_worker, 8, SMALL_3D, str(tmp_path))
    _assert_collectives_per_rank(predicted, tmp_path)
    for r in predicted["comm_per_step"]["pp_ranks"]:
        fsdp = {c["kind"]: c["count"] for c in r["collectives"] if c["source"] == "fsdp"}
        assert fsdp["all_gather"] == 5 * fsdp["reduce_scatter"]  # m + 1 gathers per unit


# Llama 3 405B as Meta trained it ("The Llama 3 Herd of Models", 2024): tp 8 × pp 16 × dp 128
# on 16,384 GPUs, 8,192-token sequences, 16M-token batches (2,048 sequences: 16 per data-
# parallel rank, one per micro-batch), bf16; here with selective checkpointing (every other
# block) and gradients reduced in bf16.
# The plan's own local_batch_size (16) and microbatches (pp) give exactly that batch.
LLAMA3_405B = ["model.config=405b", "mesh.tp=8", "mesh.pp=16", "train.seq_len=8192",
               "fsdp.mixed_precision={param_dtype: bfloat16, reduce_dtype: bfloat16}"]


def test_llama3_405b_on_16384_ranks_fits_80gb_per_stage_with_the_1f1b_bubble():
    result = _dry_run(16384, LLAMA3_405B, memory_only=True)
    mem, pipe = result["memory_per_rank"], result["pipeline"]
    assert [r["position"] for r in mem["pp_ranks"]] == ["first", "middle", "last"]
    for r in mem["pp_ranks"]:
        assert 0 < r["peak"] < 80e9
        assert r["stages"][0]["in_flight"] == min(16, 16 - r["stages"][0]["index"])
    assert mem["peak"] == max(r["peak"] for r in mem["pp_ranks"])
    assert (mem["batch"]["micro_batch_size"], mem["batch"]["grad_accum"]) == (1, 16)  # × dp 128
    assert pipe["bubble_fraction"] == pytest.approx((16 - 1) / 16)
    # one activation of 1 × 8192/8 (sequence parallel) × 16384 in bf16 per micro-batch
    assert pipe["boundary"]["bytes"] == 1 * 8192 // 8 * 16384 * 2


# The issue's command, exactly: `tpplan validate --plan plans/llama-3d.yaml --set
# model.config=405b --set mesh.tp=8 --set mesh.pp=16 --world-size 16384`. The plan is
# scale-free (16 sequences per data-parallel rank, 16 micro-batches), so it runs as written.
ISSUE_405B = ["model.config=405b", "mesh.tp=8", "mesh.pp=16"]


def test_the_issue_405b_command_fits_80gb_per_stage_and_reports_the_bubble():
    result = _dry_run(16384, ISSUE_405B, memory_only=True)
    mem, pipe = result["memory_per_rank"], result["pipeline"]
    plan = tpplan.load(PLAN, ISSUE_405B)
    p, m = plan.mesh.pp, plan.pipeline.microbatches
    assert len(mem["pp_ranks"]) == 3  # first, middle, last
    for r in mem["pp_ranks"]:
        assert 0 < r["peak"] < 80e9
    assert pipe["bubble_fraction"] == pytest.approx((p - 1) / m)
    assert pipe["bubble_closed_form"] == pytest.approx((p - 1) / m)


@pytest.mark.parametrize("plan, overrides", [
    (PLAN, ["model.kwargs.n_layers=32", "train.seq_len=32", "train.global_batch_size=16",
            "activation_checkpointing={mode: none}"]),
    (str(TEST_PLANS / "hf" / "llama-pp.yaml"), ["model.config.num_hidden_layers=32",
                                                "train.seq_len=32",
                                                "train.global_batch_size=8"]),
    # frozen blocks in the first stage only (read off the stage in place): its every block
    # traced, from a whole copy; the second stage's shallow
    (PLAN, ["model.kwargs.n_layers=32", "train.seq_len=32", "train.global_batch_size=16",
            "activation_checkpointing={mode: none}", 'freeze=["layers.{2,3}"]']),
])
def test_a_shallow_trace_of_a_stage_copies_only_the_blocks_it_runs(plan, overrides):
    """A deep stage's shallow traces (the whole step at depths 4-6, the first forward at
    1-3) build the stage with only those blocks copied (``StageBuilder``): each figure is
    the one the whole stage, copied and then cut, gives (a stage whose blocks ``freeze``
    takes differently: every block traced, as from a whole copy)."""
    from tpplan.analysis.memory.per_rank import first_forward, memory_per_rank
    from tpplan.analysis.memory.stages import stage_traces
    from tpplan.models import build_model
    from tpplan.parallel.pipeline.split import StageBuilder, stage_module

    def whole_copies(run):  # the stage copied whole at every build, the trace cutting it
        def trace(spec, mesh, build, *args, **kwargs):
            assert isinstance(build, StageBuilder)
            return run(spec, mesh, lambda: stage_module(build.model, build.stage, build.split),
                       *args, **kwargs)
        return trace

    out = {}

    def traces(r) -> None:
        spec, dims = r.plan.spec, r.resolution.dims
        build = lambda: build_model(spec.model, "meta")  # noqa: E731
        for run in (memory_per_rank, first_forward):
            cut = stage_traces(spec, r.mesh, build, r.step, dims, run)[1:]
            whole = stage_traces(spec, r.mesh, build, r.step, dims, whole_copies(run))[1:]
            out[run.__name__] = cut, whole

    r = dry_run(plan, 4, ["mesh.pp=2", "mesh.tp=2", *overrides], [("copies", traces)])
    assert not r.errors and not r.analysis_errors, (r.errors, r.analysis_errors)
    (mem, whole_mem), (first, whole_first) = out["memory_per_rank"], out["first_forward"]
    frozen = any(o.startswith("freeze") for o in overrides)
    assert [m["traced"]["depths"] for m in mem[0].values()] == \
        [[] if frozen and i == 0 else [4, 5, 6] for i in mem[0]]
    assert mem == whole_mem and first == whole_first


def test_a_stage_of_odd_length_under_selective_checkpointing_is_extrapolated_exactly():
    """A stage of 13 blocks with every second one checkpointed: its TP collectives (first
    and last stage, the last taking the first's activation) run once at 7 blocks (the
    remainder on top of 3 periods), its first forward at 9 (on top of 4), and equal running
    every block of the stage."""
    from tpplan.analysis.memory.per_rank import first_forward
    from tpplan.analysis.memory.stages import stage_traces
    from tpplan.analysis.memory.step import StageIO
    from tpplan.analysis.comm.tp_trace import trace_tp
    from tpplan.models import build_model
    from tpplan.parallel.pipeline.split import split_stages, stage_module
    from tpplan.parallel.resolve import resolve

    out = {}

    def traces(r) -> None:
        spec, dims, step = r.plan.spec, r.resolution.dims, r.step
        build = lambda: build_model(spec.model, "meta")  # noqa: E731
        whole = lambda *a, **k: first_forward(*a, **k, cut=False)  # noqa: E731
        out["first"] = [stage_traces(spec, r.mesh, build, step, dims, run)[1]
                        for run in (first_forward, whole)]
        model = build()
        split = split_stages(model, spec, dims.pp)
        received = None
        for stage in split.stages:
            module = stage_module(model, stage, split)
            res = resolve(spec, module, dims.world_size, stage=True)
            res.dims = dims
            counts = []
            for extrapolate in (True, False):
                io = StageIO(stage.index == 0, stage.index == 1, received)
                t = trace_tp(spec, res, r.mesh, lambda s=stage: stage_module(model, s, split),
                             step.seq_len, step.micro_batch, torch.float32, extrapolate, io)
                counts.append((t.depths, t.counts))
            received = received or io.sent
            out[stage.index] = counts

    r = dry_run(PLAN, 4, ["mesh.pp=2", "mesh.tp=2", "model.kwargs.n_layers=26",
                          "train.seq_len=32", "train.global_batch_size=16",
                          "activation_checkpointing={mode: selective, every: 2}"],
                [("odd", traces)])
    assert not r.errors and not r.analysis_errors, (r.errors, r.analysis_errors)
    cut, whole = out["first"]
    assert cut == whole and len(cut) == 2
    for index in (0, 1):
        (depths, counts), (none, every) = out[index]
        assert depths == [7] and none == [] and counts == every


@pytest.mark.parametrize("schedule,ranks", [("zbv", "1, 2"), ("interleaved_1f1b", "0, 2")])
def test_a_rank_too_large_stops_the_stage_traces_at_its_own_figures(schedule, ranks):
    """``pipeline_memory`` with ``over`` (``search``'s: a peak too large for the device)
    traces no stage after the first pp rank whose stages are all traced and whose peak is
    over: three of four stages here (zbv's rank 1 holds stages 1 and 2, interleaved 1F1B's
    rank 0 stages 0 and 2), that rank reported with exactly the figures the whole trace
    gives it. With ``first`` (a rank and the activation the first stage sends), that rank's
    two stages alone are traced, whichever it is; a boundary the first stage does not send
    is refused. With nothing over, the figures are those of no ``over`` at all."""
    from tpplan.analysis.memory.per_rank import memory_per_rank
    from tpplan.analysis.memory.stages import pipeline_memory
    from tpplan.models import build_model
    from tpplan.parallel.pipeline.split import split_stages

    out = {}

    def traces(r) -> None:
        spec, dims = r.plan.spec, r.resolution.dims
        build = lambda: build_model(spec.model, "meta")  # noqa: E731

        def stopped(first=None):
            traced = []

            def trace(*args, **kwargs):
                traced.append(kwargs["io"])
                return memory_per_rank(*args, **kwargs)
            got = pipeline_memory(spec, r.mesh, build, r.step, dims, trace, lambda p: True,
                                  first)
            return got, len(traced)
        out["whole"] = pipeline_memory(spec, r.mesh, build, r.step, dims)
        out["never"] = pipeline_memory(spec, r.mesh, build, r.step, dims, over=lambda p: False)
        out["stopped"] = stopped()
        sent = out["whole"][1]["boundary"]
        boundary = (tuple(sent["shape"]), getattr(torch, sent["dtype"]))
        out["first"] = [stopped((rank, boundary)) for rank in range(dims.pp)]
        wrong = ((boundary[0][0] + 1, *boundary[0][1:]), boundary[1])
        first_rank = split_stages(build(), spec, dims.pp).stages[0].rank
        with pytest.raises(RuntimeError, match="the first stage sends"):
            stopped((first_rank, wrong))  # a boundary the first stage does not send

    r = dry_run(PLAN, 8, [*SMALL_3D, f"pipeline.schedule={schedule}", "pipeline.stages_per_rank=2",
                          "model.kwargs.n_layers=8"], [("stop", traces)])
    assert not r.errors and not r.analysis_errors, (r.errors, r.analysis_errors)
    assert out["never"] == out["whole"]
    whole, whole_pipe = out["whole"]
    ((mem, pipe), traced) = out["stopped"]
    assert traced == 3 and mem["stopped_early"] and len(mem["pp_ranks"]) == 1
    rank = mem["pp_ranks"][0]
    assert ", ".join(str(s["index"]) for s in rank["stages"]) == ranks
    assert rank == whole["pp_ranks"][rank["pp_rank"]]
    assert {k: v for k, v in mem.items() if k not in ("pp_ranks", "stopped_early")} == rank
    assert pipe["boundary"] == whole_pipe["boundary"]
    for pp_rank, ((mem, pipe), traced) in enumerate(out["first"]):
        assert traced == 2 and [r["pp_rank"] for r in mem["pp_ranks"]] == [pp_rank]
        assert mem["pp_ranks"][0] == whole["pp_ranks"][pp_rank]
        assert pipe["boundary"] == whole_pipe["boundary"]


@pytest.mark.parametrize("schedule,probed", [("zbv", 2), ("interleaved_1f1b", 2), ("1f1b", 1)])
def test_a_rank_over_stops_the_floor_probes_at_rank_0(schedule, probed):
    """``memory_floor`` with ``over`` (``search``'s device) probes pp rank 0's stages first
    and no further stage once a rank whose stages are all probed has a bound over: rank 0's
    stages alone here (first and last under zbv, first and a middle one under interleaved
    1F1B, the first alone under 1F1B), its bound exactly the one the full floor gives it
    and at most that floor. With nothing over, the floor is the full one."""
    from tpplan.analysis.dryrun import fake_process_group
    from tpplan.analysis.memory.floor import memory_floor
    from tpplan.analysis.memory.per_rank import first_forward
    from tpplan.analysis.search.trace_cache import Evaluator

    probes = []

    def probe(*args, **kwargs):
        probes.append(kwargs["io"])
        return first_forward(*args, **kwargs)

    stages = [] if schedule == "1f1b" else ["pipeline.stages_per_rank=2"]
    ev = Evaluator(PLAN, [*SMALL_3D, f"pipeline.schedule={schedule}", *stages,
                          "model.kwargs.n_layers=8"], 8)
    with fake_process_group(8):
        r = ev.check([])
        assert not r.errors, r.errors
        r.mesh = r.resolution.dims.build_mesh("cpu")
        whole = memory_floor(r), r.extra["memory_floor"]
        never = memory_floor(r, over=lambda b: False), r.extra["memory_floor"]
        stopped, extra = memory_floor(r, probe, over=lambda b: True), r.extra["memory_floor"]
    assert never == whole
    whole, whole_extra = whole
    assert list(extra["pp_ranks"]) == [0] and len(whole_extra["pp_ranks"]) == 2
    assert stopped == extra["pp_ranks"][0] == whole_extra["pp_ranks"][0] <= whole
    assert [(io.first, io.last) for io in probes][:1] == [(True, False)]
    assert len(probes) == probed and extra["boundary"] == whole_extra["boundary"]
