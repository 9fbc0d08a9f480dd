"""float8 (the plan's ``float8``) composed with tensor parallelism and FSDP2, on a real gloo
mesh. float8 matmuls need CUDA at compute capability 8.9+, so the linears are converted in
torchao's emulated mode (the same casts and scales, the product in fp32): what is checked here
is the composition — which style each linear got, what FSDP2 gathers — and that it computes
what one device's float8 model does. The real float8 run is scripts/gpu_check.sh's."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("torchao")

F8 = "float8={linears: ['layers.*.attention.{wq,wk,wv,wo}', 'layers.*.feed_forward.*'], scaling: %s}"
CASES = [  # plan, overrides; world 2
    ("plans/llama-tp.yaml", ["mesh.tp=2", F8 % "tensorwise"]),  # torchao's float8 TP styles
    ("plans/llama-tp.yaml", ["mesh.tp=2", F8 % "rowwise"]),  # PyTorch's styles on Float8Linears
    ("plans/llama-fsdp.yaml", [F8 % "tensorwise"]),  # FSDP2 all-gathers the weights in float8
]


def _loss(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def _case(root, plan_path: str, overrides: list[str]) -> None:
    """One plan: the parallel step against one device's float8 step (same seed and batch on
    every rank, so FSDP's averaged gradient is the one device's)."""
    from torch.distributed.tensor import DTensor

    import tpplan
    from tpplan.models.build import build_model
    from tpplan.parallel.float8 import apply_float8, gathers_float8

    plan = tpplan.load(root / plan_path, [*overrides, "model.kwargs.n_layers=1"])
    torch.manual_seed(0)
    model = build_model(plan.require_model(), device="cpu")
    ref = copy.deepcopy(model)
    apply_float8(ref, plan.spec, fsdp=False, emulate=True)
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    ref_loss = _loss(ref, tokens)
    ref_loss.backward()
    gathers = gathers_float8(plan.spec, plan.parallel_dims(2))
    assert gathers == (plan.mesh.tp == 1 and "tensorwise" in " ".join(overrides)), overrides
    assert apply_float8(model, plan.spec, fsdp=gathers, emulate=True) == 7
    plan.apply(model, plan.build_mesh("cpu"))
    seen = {}

    def record(name):  # what the float8 linear receives, after its style's input hook
        def hook(module, args) -> None:
            seen.setdefault(name, args[0])
        return hook

    for name in ("attention.wq", "feed_forward.w2"):
        model.layers[0].get_submodule(name).register_forward_pre_hook(record(name))
    with plan.loss_context():
        loss = _loss(model, tokens)
        loss.backward()
    loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
    what = " ".join([plan_path, *overrides])
    assert torch.allclose(loss, ref_loss, rtol=1e-5), (what, loss, ref_loss)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        err = ((grad - q.grad).abs().max() / q.grad.abs().max()).item()
        assert err < 1e-4, f"{what}: grad {name} off by {err:.2e}"
    local = {k: v._local_tensor if isinstance(v, DTensor) else v for k, v in seen.items()}
    kinds = {k: type(v).__name__ for k, v in local.items()}
    weight = model.layers[0].attention.wq.weight
    if "tensorwise" in what and plan.mesh.tp > 1:
        # Float8ColwiseParallel / Float8RowwiseParallel cast the input before the matmul
        assert kinds == {"attention.wq": "Float8TrainingTensor", "feed_forward.w2": "Float8TrainingTensor"}, kinds
    else:
        assert kinds == {"attention.wq": "Tensor", "feed_forward.w2": "Tensor"}, (what, kinds)
    if plan.fsdp is not None and plan.mesh.tp == 1:  # the shard FSDP2 casts before gathering
        assert type(weight._local_tensor).__name__ == "WeightWithDynamicFloat8CastTensor", what


def _worker(rank: int, world: int, port: int, root) -> None:
    import torch.distributed as dist

    from tpplan.parallel.runtime import as_spawned_rank

    as_spawned_rank(rank, world, port)
    try:
        for plan_path, overrides in CASES:
            _case(root, plan_path, overrides)  # each plan builds its mesh on the one process group
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_float8_composes_with_tp_and_fsdp_on_gloo(root):
    """tp 2 under tensorwise scaling: the plan's colwise/rowwise rules on float8 linears become
    torchao's float8 styles (the linear's input arrives in float8), the output head's stays
    PyTorch's; rowwise scaling keeps PyTorch's styles; dp_shard 2: each float8 weight's shard
    is torchao's float8-casting tensor (FSDP2 gathers float8). Every case equals one device's
    float8 model: loss and every gradient."""
    from tpplan.parallel.runtime import spawn

    spawn(_worker, 2, root)


def test_float8_with_tp_is_planned_and_still_refused_on_cpu(root):
    """tp > 1 is no longer refused on a float8 GPU; on a CPU the refusal stays at the section."""
    import tpplan
    from tpplan.parallel.float8 import float8_problems

    spec = tpplan.load(root / "plans/llama.yaml", [F8 % "tensorwise"]).spec
    assert spec.mesh.tp == 2
    assert not float8_problems(spec, "cuda", (9, 0), "NVIDIA H200")
    (cpu,) = float8_problems(spec, "cpu")
    assert cpu.loc is spec.float8.loc and "this run is on cpu" in cpu.message


@pytest.mark.parametrize("name, plan_path, world, overrides", [
    # FSDP2 gathers the float8 weights (tensorwise); bf16 mixed precision under it
    ("fsdp 2, tensorwise", "llama-fsdp.yaml", 2,
     [F8 % "tensorwise", "fsdp.mixed_precision={param_dtype: bfloat16, reduce_dtype: float32}"]),
    ("tp 2, rowwise", "llama-tp.yaml", 2, ["mesh.tp=2", F8 % "rowwise"]),  # the casts saved for backward
])
def test_the_dry_runs_float8_memory_is_a_real_float8_steps(name, plan_path, world, overrides, root, tmp_path):
    """``validate``'s memory of a float8 plan: the linears converted as torchao converts them
    (emulated on CPU, in the dry run and in the real step alike: the same casts, scales and
    saved tensors), the trace against the real step's figures, part by part, within 10%; and
    not the figures of the plan without float8."""
    import json

    from helpers import PLANS
    from memory_measure import compare, measure_worker

    from tpplan.analysis import ANALYSES
    from tpplan.analysis.dryrun import dry_run
    from tpplan.parallel.runtime import spawn

    memory = [a for a in ANALYSES if a[0] == "memory_per_rank"]
    sets = ["train.seq_len=64", "train.micro_batch_size=2", "train.global_batch_size=8", *overrides]
    predicted = dry_run(str(PLANS / plan_path), world, sets, memory)
    plain = dry_run(str(PLANS / plan_path), world, sets[:-1] if "rowwise" in name else sets[:3] + sets[4:], memory)
    assert predicted.ok and plain.ok, (predicted.analysis_errors, plain.analysis_errors)
    spawn(measure_worker, world, str(PLANS / plan_path), sets, str(tmp_path))
    measured = json.loads((tmp_path / "measured.json").read_text())
    rows = compare(predicted.extra["memory_per_rank"], measured)
    off = [r for r in rows if abs(r["ratio"] - 1) > 0.10]
    assert not off, "\n".join(f"{r['part']}: predicted {r['predicted']}, measured {r['measured']}" for r in off)
    peak = next(r for r in rows if r["part"] == "peak")
    assert predicted.extra["memory_per_rank"]["peak"] != plain.extra["memory_per_rank"]["peak"]
    assert abs(plain.extra["memory_per_rank"]["peak"] / peak["measured"] - 1) > abs(peak["ratio"] - 1), name
