"""Context parallelism (docs/long-context.md): a sequence split over ``cp`` ranks computes what
one device computes — logits, loss and every gradient — for ring and Ulysses, at cp 2 and 4,
beside FSDP2 (dp_shard × cp), TP 2 + SP + loss parallel and pipeline stages (pp 2 × cp 2:
every stage gets its tokens' global positions), on the built-in Llama and HF Llama and
Qwen3; packed documents masked from each other equal one device with the same mask, with
and without cp and pipeline stages, and the mask is real (the unmasked loss differs). One
spawn of 4 gloo processes."""

import pytest
import torch
from helpers import run_main
from hooked import DIE_DURING_SAVE

import tpplan
from tpplan.analysis.verify.numerics import compare, make_batch, parallel_steps, reference_step
from tpplan.plan.errors import PlanErrors

pytest.importorskip("transformers")

FSDP = "plans/llama-fsdp.yaml"
TP_SP = "plans/llama.yaml"  # TP 2 + SP + loss parallel + FSDP2
HF_LLAMA = "tests/plans/hf/llama-cp.yaml"  # TP 2 + loss parallel + cp 2, ring
QWEN3 = "tests/plans/hf/qwen3-cp.yaml"  # dp_shard 2 × cp 2, ulysses
SMALL = ["model.kwargs={n_layers: 2}"]
# pipeline stages: pp 2, two micro-batches (of 2 sequences), each stage given the positions
PIPE = ["mesh.pp=2", "pipeline={schedule: 1f1b, microbatches: 2}"]

# plan, overrides, the mesh it must resolve to at world 4
CASES = [
    (FSDP, [*SMALL, "mesh.cp=2"], {"dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 1}),
    (FSDP, [*SMALL, "mesh.cp=4"], {"dp_replicate": 1, "dp_shard": 1, "cp": 4, "tp": 1}),
    (FSDP, [*SMALL, "mesh.cp=2", "activation_checkpointing=full"],  # ring's blocks recomputed
     {"dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 1}),
    (FSDP, [*SMALL, "mesh.cp=4", "context_parallel={method: ulysses, load_balance: false}"],
     {"dp_replicate": 1, "dp_shard": 1, "cp": 4, "tp": 1}),
    (TP_SP, [*SMALL, "mesh.cp=2"], {"dp_replicate": 1, "dp_shard": 1, "cp": 2, "tp": 2}),
    (TP_SP, [*SMALL, "mesh.cp=2", "context_parallel=ulysses", "activation_checkpointing=full"],
     {"dp_replicate": 1, "dp_shard": 1, "cp": 2, "tp": 2}),
    (HF_LLAMA, [], {"dp_replicate": 1, "dp_shard": 1, "cp": 2, "tp": 2}),
    (QWEN3, [], {"dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 1}),
    (QWEN3, ["mesh.cp=4", "context_parallel=ring"], {"dp_replicate": 1, "dp_shard": 1, "cp": 4, "tp": 1}),
    (FSDP, [*SMALL, "mesh.cp=2", *PIPE],
     {"pp": 2, "dp_replicate": 1, "dp_shard": 1, "cp": 2, "tp": 1}),
    (HF_LLAMA, ["mesh.tp=1", *PIPE], {"pp": 2, "dp_replicate": 1, "dp_shard": 1, "cp": 2, "tp": 1}),
]
# Packed documents: the same plans with positions restarting per document, and one plan
# without cp (the mask on its own, under TP + SP).
MASKED = [
    (FSDP, [*SMALL, "mesh.cp=4"]),
    (FSDP, [*SMALL, "mesh.cp=2", "context_parallel=ulysses"]),
    (TP_SP, [*SMALL, "mesh.cp=2"]),
    (TP_SP, SMALL),
    (HF_LLAMA, []),
    (HF_LLAMA, ["mesh.cp=1"]),  # transformers reads the documents from the position ids
    (QWEN3, []),
    (FSDP, [*SMALL, "mesh.cp=2", "context_parallel=ulysses", *PIPE]),
    (FSDP, [*SMALL, *PIPE]),  # the positions cross the stages without cp too
    (HF_LLAMA, ["mesh.tp=1", *PIPE]),
    (HF_LLAMA, ["mesh.tp=1", "mesh.cp=1", *PIPE]),
]


def packed_positions(batch: int, length: int, seed: int) -> torch.Tensor:
    """(batch, length) positions of documents packed back to back: 0, 1, ... restarting at
    each of three random boundaries per row (some inside a cp rank's chunk, some on one)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        cuts = sorted(torch.randperm(length - 2, generator=g)[:3].add(1).tolist())
        starts = [0, *cuts]
        ends = [*cuts, length]
        rows.append(torch.cat([torch.arange(e - s) for s, e in zip(starts, ends)]))
    return torch.stack(rows)


def _check(ref, par, what: str) -> None:
    assert not isinstance(par, str), f"{what}: {par}"  # a job's failure is its error line
    result = compare(ref, par, tolerance=1e-4)
    assert len(result.rows) == 2 + len(ref.grads), what  # logits, loss, every gradient
    assert result.ok, what + "\n" + "\n".join(f"{w}: {e:.2e}" for w, e in result.failures)


def test_context_parallel_matches_single_device(root, monkeypatch):
    monkeypatch.chdir(root)
    tokens = make_batch(vocab_size=256, batch=4, seq_len=32, seed=0)
    positions = packed_positions(4, 33, seed=1)
    jobs = [(p, o, tokens, 0) for p, o, _ in CASES]
    jobs += [(p, o, tokens, 0, positions) for p, o in MASKED]
    results = parallel_steps(jobs, 4)
    for (plan_path, overrides, mesh), par in zip(CASES, results):
        what = " ".join([plan_path, *overrides])
        plan = tpplan.load(plan_path, overrides)
        assert plan.parallel_dims(4).as_dict() == mesh, what
        _check(reference_step(plan, tokens, seed=0), par, what)
    for (plan_path, overrides), par in zip(MASKED, results[len(CASES):]):
        what = " ".join(["masked", plan_path, *overrides])
        plan = tpplan.load(plan_path, overrides)
        masked = reference_step(plan, tokens, seed=0, positions=positions)
        _check(masked, par, what)
        unmasked = reference_step(plan, tokens, seed=0)
        change = (unmasked.logits - masked.logits).abs().max() / masked.logits.abs().max()
        assert change > 1e-2, what  # the mask changes the result: it is real


def _errors(overrides: list[str], plan: str = FSDP, world: int = 4) -> str:
    from tpplan.models import build_model

    try:
        p = tpplan.load(plan, overrides)
        p.step_shape(world)
        p.check(build_model(p.model, device="meta"), world)
    except PlanErrors as e:
        return "\n".join(str(x) for x in e.errors)
    return ""


def test_context_parallel_mistakes_are_located_errors(root, monkeypatch, write_plan):
    monkeypatch.chdir(root)
    out = _errors(["mesh.cp=4", "train.seq_len=12"])
    assert "train.seq_len=12" in out and "not divisible by cp=4" in out and "2·cp = 8" in out
    assert "not divisible by cp=4" not in _errors(
        ["mesh.cp=4", "train.seq_len=12", "context_parallel.load_balance=false"])
    out = _errors(["mesh.cp=4", "context_parallel=ulysses"], plan=TP_SP, world=8)
    assert "ulysses with cp=4: n_heads=8 leaves 4 per tp rank" not in out  # 4 heads divide
    assert "n_kv_heads=4 leaves 2 per tp rank (tp=2), which cp does not divide" in out
    assert "context_parallel.method' must be one of ring, ulysses, got 'rign'" in \
        _errors(["mesh.cp=2", "context_parallel=rign"])
    assert "mesh cp=2 needs an 'fsdp' section" in _errors(["mesh.cp=2", "fsdp=null"])
    assert _errors(["mesh.cp=2", "mesh.pp=2", "pipeline={microbatches: 2}",
                    "train.global_batch_size=4"], world=8) == ""  # pp × cp composes
    out = _errors(["mesh.cp=2"], plan="tests/plans/minigpt.yaml")
    assert "context parallelism cannot wrap" in out and "attend(q, k, v, positions)" in out
    # sliding windows are cp's now (tests/test_cp_local_attention.py): no refusal
    assert _errors(["model.config={use_sliding_window: true, sliding_window: 8, max_window_layers: 0}"],
                   plan=QWEN3) == ""


def test_validate_reads_a_cp_plan(root, monkeypatch, capsys):
    monkeypatch.chdir(root)
    rc, out = run_main(capsys, "validate", "--plan", FSDP, "--set", "mesh.cp=2",
                       "--world-size", "4")
    assert rc == 0, out


def test_train_on_cp4_matches_one_process_and_resumes_on_cp1(reference_run, tmp_path):
    """``tpplan train`` with the sequence over 4 ranks follows the single-process curve;
    killed in its last save, it resumes from its step-10 checkpoint on one process (cp 1:
    the checkpoint does not depend on cp) and continues the same curve."""
    from trainrun import STEPS, assert_same_curve, metrics, ok, tpplan_train

    d = tmp_path / "cp4"
    stopped = tpplan_train(d, nproc=4, sets=["mesh.tp=1", "mesh.cp=4"],
                           env={DIE_DURING_SAVE: str(STEPS)})
    assert stopped.returncode != 0
    assert "dp_shard=1 × cp=4 × tp=1 on 4 cpu ranks" in stopped.stdout
    assert_same_curve(metrics(d), metrics(reference_run), range(1, 11))
    resumed = tpplan_train(d, "--resume", sets=["mesh.tp=1"])
    ok(resumed)
    assert "resumed from" in resumed.stdout and "step-000010" in resumed.stdout
    assert_same_curve(metrics(d), metrics(reference_run), range(1, STEPS + 1))


def test_document_positions_restart_after_each_separator():
    from tpplan.train.data import document_positions

    tokens = torch.tensor([[5, 6, 0, 7, 8, 9, 0, 0, 4], [1, 2, 3, 4, 5, 6, 7, 8, 9]])
    assert document_positions(tokens, 0).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 0],
                                                      [0, 1, 2, 3, 4, 5, 6, 7, 8]]
    assert document_positions(tokens, None) is None  # bytes: no boundaries
    # cp's attention builds no mask where every row is one document
    from tpplan.parallel.context.attention import one_document_per_row

    assert not one_document_per_row(document_positions(tokens, 0))
    assert one_document_per_row(torch.arange(9).expand(2, -1))


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_dry_run_cp_communication_is_what_tpplan_train_issues(method, tmp_path):
    """The dry run's count and bytes of every collective per step, the method's own
    included, equal those ``tpplan train`` issues on gloo (two micro-batches per step),
    beside TP 2 + SP and FSDP2 over dp_shard × cp; and the method's collectives are its
    minimum (docs/long-context.md): ring, K and V gathered once per layer forward and their
    gradients reduce-scattered once back; Ulysses, four all-to-alls each way."""
    overrides = ["mesh.cp=2", f"context_parallel={method}"]
    import json
    from collections import Counter

    from helpers import PLANS
    from memory_measure import trainer_collectives_worker

    from tpplan.analysis import ANALYSES
    from tpplan.analysis.dryrun import dry_run
    from tpplan.parallel.runtime import spawn

    world = 4
    overrides = [*overrides, "model.kwargs={n_layers: 2}", "train.seq_len=32",
                 "train.micro_batch_size=2", "train.global_batch_size=4", "train.steps=1",
                 "checkpoint.enabled=false", "data.max_bytes=20000",
                 f"metrics.run_dir={tmp_path / 'run'}"]
    comm = [a for a in ANALYSES if a[0] == "comm_per_step"]
    predicted = dry_run(str(PLANS / "llama.yaml"), world, overrides, comm)
    assert predicted.ok, (predicted.errors, predicted.analysis_errors)
    spawn(trainer_collectives_worker, world, str(PLANS / "llama.yaml"), overrides, str(tmp_path))
    real_count, real_bytes = Counter(), Counter()
    for dim, kind, nbytes, phase in json.loads((tmp_path / "collectives.json").read_text()):
        if phase != "step":  # the trainer's own small all-reduces (grad norm, logged loss)
            assert kind == "all_reduce" and nbytes < 1024, (dim, kind, nbytes, phase)
            continue
        real_count[(dim, kind)] += 1
        real_bytes[(dim, kind)] += nbytes
    rows = predicted.extra["comm_per_step"]["collectives"]
    assert any(r["source"] == "cp" for r in rows)
    assert predicted.extra["cp_minimum"]["at_minimum"], predicted.extra["cp_minimum"]
    assert {(r["mesh_dim"], r["kind"]): r["count"] for r in rows} == real_count
    assert {(r["mesh_dim"], r["kind"]): r["bytes"] for r in rows} == real_bytes


@pytest.mark.parametrize("plan_path, overrides", [
    (TP_SP, ["activation_checkpointing=full"]),
    (TP_SP, ["context_parallel=ulysses", "activation_checkpointing=full"]),
    (TP_SP, ["context_parallel={method: ring, load_balance: false}",
             "activation_checkpointing={mode: selective, every: 3}", "model.kwargs={n_layers: 5}"]),
    (FSDP, ["context_parallel=ulysses", "fsdp.mixed_precision={param_dtype: bfloat16}",
            "train.micro_batch_size=2", "train.global_batch_size=8"]),
    (HF_LLAMA, []),
    (QWEN3, []),
])
def test_cp_traffic_is_the_methods_minimum(plan_path, overrides, root, monkeypatch):
    """The traced cp collectives per step equal the formula of docs/long-context.md (the
    real run's equal the traced ones: the test above): under checkpointing (a recomputed
    block gathers again), gradient accumulation, bf16, tp's head split, HF attention."""
    from tpplan.analysis import ANALYSES
    from tpplan.analysis.dryrun import dry_run

    monkeypatch.chdir(root)
    comm = [a for a in ANALYSES if a[0] == "comm_per_step"]
    result = dry_run(plan_path, 4, ["mesh.cp=2", "train.seq_len=64", *overrides], comm)
    verdict = result.extra["cp_minimum"]
    assert verdict["at_minimum"], verdict
    traced = [r for r in result.extra["comm_per_step"]["collectives"] if r["mesh_dim"] == "cp"]
    assert sum(r["count"] for r in traced) == sum(r["count"] for r in verdict["collectives"]) > 0


def test_cp4_memory_is_what_the_dry_run_says_and_under_035x_of_cp1(tmp_path):
    """The debug Llama of plans/llama-long.yaml at 2,048 tokens, no checkpointing, one step
    measured for real (FSDPMemTracker, tests/memory_measure.py) on 4 gloo ranks and on one:
    the dry run's activations and peak per rank within 5% at cp 4, and cp 4's activations
    at most 0.35× cp 1's (scripts/cp_memory.py prints the same at 16,384 tokens)."""
    import json

    from helpers import PLANS
    from memory_measure import measure_worker

    from tpplan.analysis import ANALYSES
    from tpplan.analysis.dryrun import dry_run
    from tpplan.parallel.runtime import spawn

    memory = [a for a in ANALYSES if a[0] == "memory_per_rank"]
    plan = str(PLANS / "llama-long.yaml")
    measured = {}
    for cp in (4, 1):
        sets = [f"mesh.cp={cp}", "train.seq_len=2048", "activation_checkpointing=null"]
        (tmp_path / str(cp)).mkdir()
        spawn(measure_worker, cp, plan, sets, str(tmp_path / str(cp)))
        measured[cp] = json.loads((tmp_path / str(cp) / "measured.json").read_text())
        if cp == 4:
            predicted = dry_run(plan, cp, sets, memory).extra["memory_per_rank"]
    activations = {cp: max(s["Activation"] for s in m["end_forward"]) for cp, m in measured.items()}
    assert abs(predicted["activations"] / activations[4] - 1) <= 0.05, (predicted, activations)
    assert abs(predicted["peak"] / measured[4]["peak"]["Total"] - 1) <= 0.05, predicted
    assert activations[4] <= 0.35 * activations[1], activations


def test_fit_proposes_the_smallest_cp_that_fits(root, monkeypatch):
    """``--device`` fit on a sequence that does not fit one rank: ``mesh.cp`` doubled and
    each degree dry-run again, the first that fits proposed (here cp 4: cp 2 falls short)."""
    from tpplan.analysis import ANALYSES
    from tpplan.analysis.dryrun import dry_run
    from tpplan.analysis.memory.fit import fit, needed
    from tpplan.plan.devices import GiB, Device

    monkeypatch.chdir(root)
    memory = [a for a in ANALYSES if a[0] == "memory_per_rank"]
    sets = ["mesh.cp=1", "train.seq_len=16384", "train.local_batch_size=1"]
    peaks = {cp: dry_run("plans/llama-long.yaml", 4, [*sets, f"mesh.cp={cp}"], memory)
             .extra["memory_per_rank"]["peak"] for cp in (1, 2, 4)}
    device = Device("small", (needed(peaks[2]) + needed(peaks[4])) // 2)  # cp 4 fits, 2 not
    result = dry_run("plans/llama-long.yaml", 4, sets, memory)
    out = fit(result, device, "plans/llama-long.yaml", sets)
    assert not out["fits"] and out["fitting"]["set"] == ["mesh.cp=4"], out["changes"]
    assert out["fitting"]["peak"] == peaks[4] and "cp 4 (context parallelism" in out["fitting"]["change"]
    assert device.memory < 2 * GiB
