"""Promises of ``tpplan validate``'s analyses: the communication it reports is what the
plan really does on a gloo mesh, parameter bytes are the real local shards, FSDP units are
the sizes ``fully_shard`` really gathers, and a plan's distance from the Megatron minimum
is measured and explained."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from helpers import PLANS, TEST_PLANS

from tpplan.analysis import ANALYSES
from tpplan.analysis.dryrun import dry_run
from tpplan.analysis.comm.tp_trace import trace_tp
from tpplan.cli import main
from tpplan.models import build_model
from tpplan.parallel.fsdp_units import unit_sizes
from tpplan.parallel.runtime import as_spawned_rank, spawn
from tpplan.plan.specs import torch_dtype

SMALL = ["train.seq_len=16", "train.micro_batch_size=2"]
# Where only communication is asserted, only it runs (memory runs a whole step on fake tensors).
COMM = [a for a in ANALYSES if a[0] == "comm_per_step"]


def _real_worker(rank: int, world: int, port: int, plan_path: str, overrides: list[str],
                 micro: int, seq_len: int, out: str) -> None:
    """Apply the whole plan (TP + FSDP) on real CPU tensors and count one micro-batch."""
    as_spawned_rank(rank, world, port)
    import warnings

    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    import tpplan
    from tpplan.analysis.comm.counting import CollectiveRecorder

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    plan = tpplan.load(plan_path, overrides)
    torch.manual_seed(0)
    model = build_model(plan.model, device="cpu")
    mesh = plan.build_mesh("cpu")
    try:
        model = plan.apply(model, mesh)
        tokens = torch.randint(0, 256, (micro, seq_len + 1))
        with CollectiveRecorder() as rec:
            with plan.loss_context():
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
                loss.backward()
        tp_group = mesh["tp"].get_group().group_name
        dp_group = mesh["dp_shard"].get_group().group_name
        # DTensor (TP) issues functional collectives; FSDP2 issues c10d ones on dp groups.
        functional = {str(op): n for op, n in rec.get_comm_counts().items()
                      if "c10d_functional" in str(op)}
        sizes, fsdp_gathers = Counter(), Counter()
        for c in rec.collectives:
            if c.group == tp_group:
                sizes[(c.kind, c.backward, c.bytes)] += 1
            elif c.group == dp_group and c.kind == "all_gather" and not c.backward:
                fsdp_gathers[c.bytes] += 1  # each unit once in forward: what fully_shard built
        local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
                    for p in model.parameters())
        if rank == 0:
            torch.save({"functional": functional, "sizes": dict(sizes), "param_bytes": local,
                        "fsdp_gathers": dict(fsdp_gathers)}, Path(out) / "real.pt")
    finally:
        dist.destroy_process_group()


def _traced(result) -> Counter:
    out = Counter()
    for row in result.extra["comm_per_step"]["collectives"]:
        if row["source"] == "tp":
            out[row["kind"]] += row["count"]
    return out


@pytest.mark.parametrize("plan, extra", [
    ("llama.yaml", []), ("llama-tp.yaml", []),
    # Recomputation re-issues collectives in backward; the trace must see the same ones.
    ("llama.yaml", ["activation_checkpointing={mode: full}"]),
    # A HuggingFace model: its mask code is traced on meta too (issue 11).
    ("hf-llama.yaml", [f"model.config.{k}={v}" for k, v in (
        ("num_hidden_layers", 3), ("hidden_size", 64), ("num_attention_heads", 4),
        ("num_key_value_heads", 2), ("intermediate_size", 128), ("vocab_size", 256))]),
    # A user model whose attention runs on DTensors (SDPA sharded over heads), tied head.
    pytest.param(str(TEST_PLANS / "dtensor-attention.yaml"), [], id="dtensor-attention"),
])
def test_tp_collectives_and_param_bytes_match_a_real_gloo_run(plan, extra, tmp_path):
    world, micro, seq = 4, 2, 16
    plan = str(PLANS / plan)  # an absolute path stays itself
    dp = dry_run(plan, world, SMALL, ()).report.dims.dp
    # One micro-batch per optimizer step, so per-step figures are per-micro-batch ones.
    overrides = SMALL + extra + [f"train.global_batch_size={micro * dp}"]
    result = dry_run(plan, world, overrides, ANALYSES)
    assert result.ok, (result.errors, result.analysis_errors)
    spawn(_real_worker, world, plan, overrides, micro, seq, str(tmp_path))
    real = torch.load(tmp_path / "real.pt")

    # Counts: CommDebugMode's own count of the real run, by functional collective op.
    kind_of = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
               "reduce_scatter_tensor": "reduce_scatter"}
    real_counts = Counter()
    for op, n in real["functional"].items():
        real_counts[kind_of[op.rsplit(".", 1)[-1]]] += n
    assert _traced(result) == real_counts

    # Sizes: every (kind, pass, bytes) of the real run, against the meta trace.
    traced = Counter()
    for (kind, dim, bw, nbytes, _module), n in result.tp_trace.counts.items():
        assert dim == "tp"
        traced[(kind, bw, nbytes)] += n
    assert traced == Counter(real["sizes"])

    assert result.extra["memory_per_rank"]["parameters"] == real["param_bytes"]


def test_the_recorder_lets_a_model_write_into_a_modules_output_and_names_backward_modules():
    """A parent that adds into its child's output in place (Llama 4's MoE, Gemma 3n's AltUp)
    runs under the recorder with the gradients it has without it, and a backward operation
    placed after a module's forward (as a style's output hook places its redistribution) is
    named for that module, also where the parent returns the module's output as it is."""
    from tpplan.analysis.comm.counting import CollectiveRecorder

    seen: list[str] = []
    recorder: list[CollectiveRecorder] = []

    class Probe(torch.autograd.Function):  # records the module named when its backward runs
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            seen.extend(r.advanced_module_tracker.name for r in recorder)
            return g

    class Parent(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
            self.c.register_forward_hook(lambda m, i, o: Probe.apply(o))

        def forward(self, x):
            out = self.a(x)
            out.add_(self.b(x))  # in place, into a hooked module's output
            return self.c(out)  # the child's output, as it is

    torch.manual_seed(0)
    model, x = nn.Sequential(Parent()), torch.randn(3, 4)
    model(x).square().sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with CollectiveRecorder() as rec:
        recorder.append(rec)
        model(x).square().sum().backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), want))
    assert seen == ["Sequential.0.c"]


@pytest.mark.parametrize("plan", ["llama.yaml", "llama-tp.yaml"])
def test_reference_plans_sit_exactly_at_the_minimum(plan):
    result = dry_run(str(PLANS / plan), 8, (), COMM)
    minimum = result.extra["comm_minimum"]
    assert minimum["at_minimum"], minimum["extra"]
    assert minimum["measured_wire_bytes"] == minimum["wire_bytes"]


def test_siblings_without_a_shared_prepare_input_are_flagged_with_their_extra_count():
    path = str(TEST_PLANS / "wasteful-siblings.yaml")
    result = dry_run(path, 4, (), COMM)
    minimum = result.extra["comm_minimum"]
    assert not minimum["at_minimum"]

    # Each colwise sibling under a parent without prepare_input makes its own input a
    # DTensor, so each all-reduces its own input gradient in backward; with one shared
    # prepare_input the gradients add up first and are reduced once. The extra per block
    # is (siblings - 1) per parent: (3 - 1) for wq/wk/wv plus (2 - 1) for w1/w3.
    model = build_model(result.plan.model, device="meta")
    blocks = list(model.layers)
    siblings = [sum(isinstance(m, nn.Linear) for m in (b.attention.wq, b.attention.wk,
                                                        b.attention.wv)) for b in blocks]
    ffn = [sum(isinstance(m, nn.Linear) for m in (b.feed_forward.w1, b.feed_forward.w3))
           for b in blocks]
    per_micro_batch = sum(s - 1 for s in siblings) + sum(f - 1 for f in ffn)
    expected = per_micro_batch * result.extra["comm_per_step"]["grad_accum"]
    assert minimum["extra"] == [{"kind": "all_reduce", "pass": "backward", "count": expected,
                                 "bytes": minimum["extra"][0]["bytes"]}]
    explained = sum(r["extra_count"]["all_reduce (backward)"] for r in minimum["reasons"])
    assert explained == per_micro_batch
    assert {r["where"] for r in minimum["reasons"]} == {"layers.*.attention",
                                                        "layers.*.feed_forward"}


def test_validate_prints_memory_and_communication_and_json_has_no_private_keys(capsys):
    assert main(["validate", "--plan", str(PLANS / "llama.yaml"), "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "memory per rank" in out and "communication per rank" in out
    assert main(["validate", "--plan", str(PLANS / "llama.yaml"), "--world-size", "8",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert not [k for k in data if k.startswith("_")]
    mem = data["memory_per_rank"]
    parts = ("parameters", "buffers", "optimizer", "gradients", "fsdp_unsharded",
             "accumulated_gradients", "activations", "transients")
    assert mem["total"] == sum(mem[k] for k in parts)
    # The peak is one moment of the step: its parts add up to it, none above its largest.
    assert mem["peak"] == sum(mem["at_peak"].values()) <= mem["total"]
    assert all(mem["at_peak"][k] <= mem[k] for k in parts if k != "activations")
    assert {r["source"] for r in data["comm_per_step"]["collectives"]} == {"tp", "fsdp"}


def test_colwise_feeding_colwise_is_flagged_with_its_gathers():
    path = str(TEST_PLANS / "colwise-chain.yaml")
    result = dry_run(path, 4, ["train.global_batch_size=8"], COMM)  # 1 micro-batch
    minimum = result.extra["comm_minimum"]
    assert not minimum["at_minimum"]
    layers = len(result.model.layers)
    # Per block, w2 (colwise, input shard(-1), output replicate) replaces the rowwise
    # layer's all-reduce in forward by an all-gather of its hidden-sharded input and one of
    # its feature-sharded output, and adds a reduce-scatter of its input gradient back to
    # hidden shards in backward (the MLP's backward all-reduce, for w1/w3's input gradient,
    # is there either way). Every kind that differs is listed, with its sign.
    extra = {(e["kind"], e["pass"]): e["count"] for e in minimum["extra"]}
    assert extra == {("all_gather", "forward"): 2 * layers, ("all_reduce", "forward"): -layers,
                     ("reduce_scatter", "backward"): layers}
    assert minimum["verdict"] == "above"
    [reason] = minimum["reasons"]
    assert reason["where"] == "layers.*.feed_forward.w2"
    assert reason["extra_count"] == {"all_gather (forward)": 2 * layers,
                                     "reduce_scatter (backward)": layers}


@pytest.mark.parametrize("plan, ac, layers", [
    ("llama.yaml", "{mode: none}", 12), ("llama-tp.yaml", "{mode: full}", 12),
    ("llama.yaml", "{mode: selective, every: 2}", 12),
    # a period that does not divide the depth: r, r + k, r + 2k blocks
    ("llama.yaml", "{mode: selective, every: 2}", 13),
    ("llama-tp.yaml", "{mode: selective, every: 3}", 11),
])
def test_tracing_three_blocks_and_extrapolating_equals_tracing_every_block(plan, ac, layers):
    def whole(result) -> None:  # the same trace, every block run
        spec, res, step = result.plan.spec, result.report.resolution, result.step
        result.extra["whole"] = trace_tp(spec, res, result.mesh,
                                         lambda: build_model(spec.model, "meta"), step.seq_len,
                                         step.micro_batch, torch_dtype(step.param_dtype),
                                         extrapolate=False)

    overrides = [f"model.kwargs.n_layers={layers}", f"activation_checkpointing={ac}"]
    result = dry_run(str(PLANS / plan), 8, overrides, COMM + [("whole", whole)])
    assert result.ok, (result.errors, result.analysis_errors)
    cut, every = result.tp_trace, result.extra["whole"]
    assert cut.depths and every.depths == []  # the fast path was taken, then every block
    assert cut.counts == every.counts


@pytest.mark.parametrize("plan, world, extra", [
    ("llama.yaml", 4, []),  # TP-sharded shards, split again over dp_shard=2
    ("llama-fsdp.yaml", 3, ["train.global_batch_size=6"]),  # 3 does not divide 256 rows: padding
])
def test_fsdp_unit_sizes_are_what_fully_shard_gathers(plan, world, extra, tmp_path):
    """Unit sizes computed from shapes and the mesh, against the bytes each real
    ``fully_shard`` unit all-gathers in forward on a gloo mesh."""
    overrides = SMALL + extra
    result = dry_run(str(PLANS / plan), world, overrides, ())
    assert result.ok, result.errors
    res = result.report.resolution
    predicted = Counter(u.elements * 4 for u in unit_sizes(result.model, res, res.dims))  # fp32
    spawn(_real_worker, world, str(PLANS / plan), overrides, 1, 16, str(tmp_path))
    assert Counter(torch.load(tmp_path / "real.pt")["fsdp_gathers"]) == predicted


def test_a_failing_analysis_is_an_error_with_its_reason(write_plan, capsys):
    """A model whose forward does not take a batch of token ids cannot be run as the
    trainer runs it: validate says so for memory and communication, with the reasons, after
    the module table; the plan itself is valid, so it exits 0, and 1 under ``--strict``."""
    path = write_plan("mesh: {tp: 2}\nmodel: {factory: 'toy_models:float_mlp'}\n"
                      "tensor_parallel: {'0': colwise, '1': rowwise}\n")
    assert main(["validate", "--plan", path, "--world-size", "2"]) == 0
    captured = capsys.readouterr()
    assert "memory per rank could not be computed for this model" in captured.err
    assert "communication per step could not be computed for this model" in captured.err
    assert "the plan is valid, but 2 of its analyses could not run" in captured.out
    assert main(["validate", "--plan", path, "--world-size", "2", "--strict"]) == 1
    capsys.readouterr()
    assert main(["validate", "--plan", path, "--world-size", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert not data["ok"] and data["errors"] == []
    failures = {f["analysis"]: f["message"] for f in data["analysis_errors"]}
    assert set(failures) == {"memory_per_rank", "comm_per_step"} and all(failures.values())
    assert data["comm_per_step"] == {"error": failures["comm_per_step"]}
    assert data["memory_per_rank"] == {"error": failures["memory_per_rank"]}
    assert main(["validate", "--plan", path, "--world-size", "2", "--json", "--strict"]) == 1


@pytest.mark.parametrize("factory", ["mini_gpt", "mini_gpt_double"])
def test_the_minimum_follows_the_models_dtype(factory):
    """A float64 model moves 8-byte activations: its minimum does too, so the reference
    layout sits at it in either dtype."""
    result = dry_run(str(TEST_PLANS / "minigpt.yaml"), 4,
                     [f"model.factory=toy_models:{factory}", "train.seq_len=32"], ANALYSES)
    assert result.ok, (result.errors, result.analysis_errors)
    minimum = result.extra["comm_minimum"]
    assert minimum["at_minimum"] and minimum["verdict"] == "at", minimum["extra"]
    dtype = "float64" if factory.endswith("double") else "float32"
    assert result.extra["memory_per_rank"]["batch"]["compute_dtype"] == dtype


def test_differences_from_the_minimum_print_with_their_sign():
    from rich.console import Console

    from tpplan.commands.validate import render_comm

    out = Console(record=True, width=200)
    mini = {"at_minimum": False, "verdict": "below", "style": "tensor parallel",
            "wire_bytes": 2048, "measured_wire_bytes": 1024, "reasons": [],
            "extra": [{"kind": "all_reduce", "pass": "forward", "count": -3, "bytes": -1024},
                      {"kind": "all_gather", "pass": "backward", "count": 0, "bytes": 512}]}
    render_comm(out, {"grad_accum": 1, "collectives": []}, mini)
    text = out.export_text()
    assert "TP below the minimum" in text and "+-" not in text
    assert "-3 all_reduce in forward (-1.00 KiB)" in text
    assert "+0 all_gather in backward (+512 B)" in text


@pytest.mark.parametrize("shape,ranks,dim", [((10, 4), 4, 0), ((5, 3), 4, 0), ((6, 2), 4, 0), ((0, 3), 2, 0),
                                             ((4, 7), 8, 1), ((3, 2), 1, 0), ((2048, 8), 2048, 0)])
def test_fsdp_chunks_made_on_demand_are_the_chunks_fsdp_makes(shape, ranks, dim):
    """The dry run's lazy stand-in for FSDP2's ``_chunk_with_empty`` hands out the same
    views: shape, stride and offset into the parameter, every index and from the end."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    from tpplan.analysis.dryrun import ChunksOnDemand

    t = torch.empty(shape)
    eager, lazy = _chunk_with_empty(t, ranks, dim), ChunksOnDemand(t, ranks, dim)
    assert len(lazy) == len(eager) == ranks
    for i in [*range(ranks), -1]:
        a, b = eager[i], lazy[i]
        assert (a.shape, a.stride(), a.storage_offset()) == (b.shape, b.stride(), b.storage_offset())
        assert (a.numel() == 0 or a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


def test_the_fake_group_makes_only_this_ranks_groups_of_a_mesh():
    """Under the dry run's fake group a mesh makes the process groups that hold this rank
    only (one per dimension, not one per subgroup); each is the group a real run gives rank
    0: the same ranks, in order."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    from tpplan.analysis.dryrun import fake_process_group
    from tpplan.parallel.mesh import ParallelDims

    dims = ParallelDims(pp=4, dp_replicate=8, dp_shard=4, cp=1, tp=8)
    with fake_process_group(dims.world_size):
        before = _world.group_count  # every new_group, a member or not
        mesh = dims.build_mesh("cpu")
        made = _world.group_count - before
        sizes = {n: mesh[n].size() for n in ("pp", "dp_replicate", "dp_shard", "tp")}
        ranks = {n: dist.get_process_group_ranks(mesh[n].get_group()) for n in sizes}
    assert made <= 4, made  # 128 + 32 + 256 + 128 subgroups in a real run's every rank
    assert sizes == dict(pp=4, dp_replicate=8, dp_shard=4, tp=8)
    assert ranks["tp"] == list(range(8)) and ranks["dp_shard"] == [0, 8, 16, 24]
    assert ranks["dp_replicate"] == [32 * i for i in range(8)]
    assert ranks["pp"] == [256 * i for i in range(4)]
