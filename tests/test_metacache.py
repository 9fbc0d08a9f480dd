"""The meta kernels' output cache (tpplan/parallel/meta_kernel_cache.py) against the kernels
themselves: every operator of a forward and backward on meta, on four models (the
built-in Llama with grouped KV heads, the built-in MoE with a shared expert, HF Llama, HF
Qwen3-MoE), makes outputs of the same shape, strides, dtype, storage offset and storage
size with the cache as without it, its second run served from the cache; what it must
never keep (views, in-place ops, an output on an input's storage, fake tensors) runs; and
the TP trace counts the same collectives either way."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from helpers import PLANS, TEST_PLANS
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import tpplan
from tpplan.models import build_model
from tpplan.parallel.meta_kernel_cache import MetaCache, MetaCacheMode

MODELS = {
    "llama-gqa": (PLANS / "llama.yaml", ["model.kwargs.n_layers=3", "model.kwargs.n_heads=8",
                                         "model.kwargs.n_kv_heads=2"]),
    "moe-shared": (PLANS / "moe.yaml", [
        "model.kwargs.n_layers=4", "model.kwargs.dim=64", "model.kwargs.n_heads=4",
        "model.kwargs.n_kv_heads=2", "model.kwargs.moe_hidden=32", "model.kwargs.num_experts=4",
        "model.kwargs.top_k=1", "model.kwargs.moe_every=2", "model.kwargs.shared_hidden=48"]),
    "hf-llama": (TEST_PLANS / "hf" / "llama-pp.yaml", ["model.config.num_hidden_layers=2"]),
    "hf-qwen3-moe": (PLANS / "qwen3-moe-ep-tiny.yaml", []),
}


class _Outputs(TorchDispatchMode):
    """Every operator's name and its outputs' metadata, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = out if isinstance(out, (tuple, list)) else [out]
        self.seen.append((str(func), [
            (tuple(t.shape), t.stride(), t.dtype, t.storage_offset(),
             t.untyped_storage().nbytes(), t.device.type) if isinstance(t, torch.Tensor) else t
            for t in flat]))
        return out


def _step(model: torch.nn.Module, cache: MetaCache | None) -> list[tuple]:
    model.zero_grad(set_to_none=True)
    tokens = torch.zeros(2, 16, dtype=torch.long, device="meta")
    outputs = _Outputs()
    with MetaCacheMode(cache) if cache else contextlib.nullcontext(), outputs:
        out = model(tokens)
        logits = out if isinstance(out, torch.Tensor) else out.logits
        F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()).backward()
    grads = [(n, tuple(p.grad.shape), p.grad.stride(), p.grad.dtype)
             for n, p in model.named_parameters() if p.grad is not None]
    return outputs.seen + grads


@pytest.mark.parametrize("name", list(MODELS))
def test_forward_and_backward_on_meta_make_the_same_tensors_with_the_cache(name):
    if name.startswith("hf"):
        pytest.importorskip("transformers")
    path, overrides = MODELS[name]
    plan = tpplan.load(str(path), overrides)
    model = build_model(plan.model, "meta")
    plain = _step(model, None)
    cache = MetaCache()
    first = _step(model, cache)
    hits, misses = cache.hits, cache.misses
    second = _step(model, cache)
    assert first == plain and second == plain
    # the second run came from the cache: every operator it takes was kept by the first
    assert cache.misses == misses and cache.hits - hits > hits > 0
    assert 0 < len(cache.kept) <= misses


def test_what_the_cache_must_not_keep_runs_every_time():
    cache = MetaCache()
    x = torch.zeros(4, 6, device="meta")
    with MetaCacheMode(cache):
        for _ in range(2):
            assert x.view(6, 4).untyped_storage()._cdata == x.untyped_storage()._cdata
            y = torch.ops.aten._unsafe_view(x, [24])  # no alias in its schema, yet one
            assert y.untyped_storage()._cdata == x.untyped_storage()._cdata
            assert x.add_(1) is x
            z = x + 1  # kept, then served: a storage of its own each time
            assert z.untyped_storage()._cdata != x.untyped_storage()._cdata
        with FakeTensorMode() as fake:  # a mode below makes its own tensors
            f = fake.from_tensor(torch.zeros(4, 6))
            assert type(f + 1) is FakeTensor and type(torch.ones(3)) is FakeTensor
        real = torch.ones(2)
        assert (real + 1).tolist() == [2.0, 2.0]  # CPU tensors: the kernel, their values
    assert cache.hits == 1  # only x + 1, the second time
    assert cache._ops[torch.ops.aten._unsafe_view.default] is False  # found out, refused


@pytest.mark.parametrize("plan, overrides", [
    ("llama.yaml", ["model.kwargs.n_layers=5"]),  # TP + SP, loss parallel
    ("moe-tp.yaml", ["model.kwargs.n_layers=2", "model.kwargs.dim=64",
                     "model.kwargs.n_heads=4", "model.kwargs.n_kv_heads=2"]),  # ep beside tp
])
def test_the_tp_trace_counts_the_same_collectives_without_the_cache(plan, overrides,
                                                                    monkeypatch):
    import tpplan.analysis.comm.counting as counting
    from tpplan.analysis import ANALYSES
    from tpplan.analysis.dryrun import dry_run

    comm = [a for a in ANALYSES if a[0] == "comm_per_step"]
    args = (str(PLANS / plan), 8, ["train.seq_len=16", *overrides], comm)
    hits = counting.META.hits
    cached = dry_run(*args)
    assert counting.META.hits > hits
    monkeypatch.setattr(counting, "META", lambda func, a, kw: func(*a, **kw))
    plain = dry_run(*args)
    assert cached.ok and plain.ok, (cached.errors, cached.analysis_errors)
    assert cached.tp_trace.counts and cached.tp_trace.counts == plain.tp_trace.counts
    assert cached.extra["comm_per_step"] == plain.extra["comm_per_step"]
