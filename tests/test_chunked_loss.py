"""The chunked cross-entropy (tpplan.parallel.tp.loss) equals PyTorch's: loss and gradients,
with ignored targets, uneven chunks, fp32 and bf16 logits; and under loss parallel on a real
gloo mesh (tp 2, an lm_head split colwise over a vocabulary that does not divide by 2),
against one device's plain loss and against PyTorch's own loss_parallel cross-entropy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tpplan.parallel.tp.loss import CHUNKED_MIN_VOCAB, IGNORE_INDEX, cross_entropy

VOCAB = CHUNKED_MIN_VOCAB + 3  # odd: under tp 2 the shards are uneven


def _batch(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(2, 7, VOCAB, generator=g) * 3).to(dtype).requires_grad_()
    targets = torch.randint(0, VOCAB, (2, 7), generator=g)
    targets[0, 2] = targets[1, 6] = IGNORE_INDEX
    return logits, targets


def _plain(logits, targets, reduction="sum"):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                           ignore_index=IGNORE_INDEX, reduction=reduction)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_chunked_equals_plain_fp32(reduction):
    logits, targets = _batch()
    ref = _plain(logits, targets, reduction)
    (g_ref,) = torch.autograd.grad(ref * 1.7, logits)
    got = cross_entropy(logits, targets, chunk=4, reduction=reduction)  # 14 tokens: 4, 4, 4, 2
    (g_got,) = torch.autograd.grad(got * 1.7, logits)
    assert torch.allclose(got, ref, rtol=1e-6, atol=1e-5), (got, ref)
    assert torch.allclose(g_got, g_ref, rtol=1e-5, atol=1e-7)
    assert g_got[0, 2].abs().max() == 0  # an ignored target has no gradient


def test_chunked_bf16_gradient_in_the_logits_dtype():
    logits, targets = _batch(torch.bfloat16)
    ref = _plain(logits, targets)
    (g_ref,) = torch.autograd.grad(ref, logits)
    got = cross_entropy(logits, targets, chunk=5)
    (g_got,) = torch.autograd.grad(got, logits)
    assert g_got.dtype == torch.bfloat16
    assert torch.allclose(got, ref, rtol=1e-5)
    # both end in bf16 from the same fp32 values: equal up to one rounding
    assert torch.allclose(g_got.float(), g_ref.float(), rtol=1e-2, atol=1e-6)


def test_small_vocabulary_or_chunk_zero_runs_the_plain_loss():
    logits, targets = _batch()
    assert cross_entropy(logits, targets, chunk=0).grad_fn.name() != "_ChunkedCrossEntropyBackward"
    assert "Chunked" in cross_entropy(logits, targets, chunk=3).grad_fn.name()
    small = logits[..., :100].detach().requires_grad_()
    assert "Chunked" not in cross_entropy(small, targets.clamp(-100, 99), chunk=3).grad_fn.name()


def _loss_parallel_worker(mesh) -> None:
    from torch import nn
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

    torch.manual_seed(0)
    head = nn.Linear(16, VOCAB, bias=False)
    ref_head = nn.Linear(16, VOCAB, bias=False)
    ref_head.load_state_dict(head.state_dict())
    h = torch.randn(2, 7, 16)
    targets = torch.randint(0, VOCAB, (2, 7))
    targets[1, 3] = IGNORE_INDEX
    # the last token of the vocabulary is on the last rank: a target there checks the offset
    targets[0, 0] = VOCAB - 1
    ref = _plain(ref_head(h), targets)
    ref.backward()
    parallelize_module(head, mesh, ColwiseParallel(input_layouts=Replicate(),
                                                   output_layouts=Shard(-1), use_local_output=False))
    results = {}
    for name, chunk in (("pytorch", 0), ("chunked", 3)):
        head.weight.grad = None
        x = h.clone().requires_grad_()
        with loss_parallel():
            loss = cross_entropy(head(x), targets, chunk)
            loss.backward()
        loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        results[name] = (loss.detach(), head.weight.grad.full_tensor(), x.grad)
    for name, (loss, wgrad, _) in results.items():
        assert torch.allclose(loss, ref.detach(), rtol=1e-6), (name, loss, ref)
        assert torch.allclose(wgrad, ref_head.weight.grad, rtol=1e-5, atol=1e-6), name
    assert torch.allclose(results["chunked"][2], results["pytorch"][2], rtol=1e-5, atol=1e-6)


def _fused_adamw_on_dtensors(mesh) -> None:
    """The trainer's CUDA optimizer (fused AdamW) takes FSDP2's and TP's DTensor parameters:
    PyTorch's fused kernel (CPU has one too) steps sharded parameters as the loop does."""
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(1)
    full = [torch.randn(6, 4), torch.randn(5)]
    runs = []
    for kwargs in ({}, {"fused": True}):
        params = [torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)])) for t in full]
        opt = torch.optim.AdamW(params, lr=0.1, weight_decay=0.1, **kwargs)
        for step in range(3):
            for p, t in zip(params, full):
                p.grad = distribute_tensor(t * (step + 1) - 0.5, mesh, [Shard(0)])
            opt.step()
        runs.append([p.full_tensor() for p in params])
    for a, b in zip(*runs):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def _worker(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from tpplan.parallel.runtime import as_spawned_rank

    as_spawned_rank(rank, world, port)
    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        _loss_parallel_worker(mesh)
        _fused_adamw_on_dtensors(mesh)
    finally:
        dist.destroy_process_group()


def test_chunked_under_loss_parallel_and_fused_adamw_on_gloo():
    """One spawn of 2 gloo ranks: the chunked loss under loss parallel, then fused AdamW on
    sharded parameters (each raises in its rank on a mismatch)."""
    from tpplan.parallel.runtime import spawn

    spawn(_worker, 2)


def test_adamw_fused_on_cuda_default_elsewhere():
    from tpplan.plan.specs import TrainSpec
    from tpplan.train.optim import adamw_implementation, make_optimizer

    assert adamw_implementation("cuda") == {"fused": True}
    assert adamw_implementation("cpu") == {}
    opt, trained = make_optimizer(torch.nn.Linear(3, 2), TrainSpec())
    assert len(trained) == 2 and not opt.defaults["fused"]


def test_dry_run_counts_the_chunked_loss(capsys):
    """The dry run traces the trainer's loss: over a 40,000-word vocabulary (tp 2, loss
    parallel) the chunked loss's peak is below the plain one's by the fp32 logits it skips."""
    import json

    from helpers import run_main

    peaks = {}
    for chunk in (0, 256):
        rc, out = run_main(capsys, "validate", "--plan", "plans/llama.yaml", "--world-size", "2",
                           "--set", "model.kwargs.vocab_size=40000", "--set", f"train.loss_chunk={chunk}",
                           "--json")
        assert rc == 0, out
        peaks[chunk] = json.loads(out)["memory_per_rank"]["peak"]
    # one micro-batch of 8 × 256 tokens: each fp32 copy of a rank's 20,000-word shard of the
    # logits is 164 MB; the plain loss holds two at its backward (936 MB peak against 506 MB)
    assert peaks[256] < 0.7 * peaks[0], peaks


def test_loss_chunk_below_zero_is_a_located_error(tmp_path):
    from tpplan.api import load
    from tpplan.plan.errors import PlanErrors

    plan = tmp_path / "p.yaml"
    plan.write_text("extends: %s\ntrain:\n  loss_chunk: -1\n" % (Path("plans/llama.yaml").resolve()))
    with pytest.raises(PlanErrors) as e:
        load(plan)
    assert f"{plan}:3:15" in str(e.value) and "'train.loss_chunk'" in str(e.value), str(e.value)
