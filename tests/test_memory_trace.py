"""The memory trace's own promises: tracing a deep model at three shallow depths and
extrapolating gives what tracing every block gives, moment for moment."""

from __future__ import annotations

import pytest
import torch
from helpers import PLANS

from tpplan.analysis.dryrun import dry_run
from tpplan.analysis.memory.per_rank import first_forward, memory_per_rank
from tpplan.models import build_model


@pytest.mark.parametrize("ac, layers", [("{mode: full}", 16), ("{mode: selective, every: 2}", 32)])
def test_tracing_three_depths_and_extrapolating_equals_tracing_every_block(ac, layers):
    def both(result) -> None:
        spec, step = result.plan.spec, result.step
        model = result.model

        def build():
            return build_model(spec.model, "meta")

        n = len(model.layers)
        result.extra["cut"] = memory_per_rank(spec, result.mesh, build, step, n, "layers")
        result.extra["every"] = memory_per_rank(spec, result.mesh, build, step, n, "layers",
                                                cut=False)

    overrides = [f"model.kwargs.n_layers={layers}", f"activation_checkpointing={ac}",
                 "train.seq_len=8", "train.micro_batch_size=1", "train.global_batch_size=6"]
    result = dry_run(str(PLANS / "llama.yaml"), 4, overrides, [("both", both)])
    assert result.ok, (result.errors, result.analysis_errors)
    cut, every = result.extra["cut"], result.extra["every"]
    assert cut["traced"]["depths"] and not every["traced"]["depths"]
    assert cut["traced"]["micro_batches"] == 3  # 3 micro-batches: first, middle, last
    for key in ("parameters", "optimizer", "gradients", "fsdp_unsharded",
                "accumulated_gradients", "activations", "transients", "peak", "at_peak",
                "peak_at"):
        assert cut[key] == every[key], key


@pytest.mark.parametrize("every, layers", [(1, 9), (2, 13), (3, 20)])
def test_a_first_forward_run_once_shallow_and_extrapolated_equals_running_every_block(
        every, layers, monkeypatch):
    """The first forward (the memory floor's probe) run once at r + 4k blocks (k leaves a
    remainder r: 13 blocks, every second checkpointed, at 9; 20 blocks, every third, at
    14) and extrapolated from the activations each period of blocks adds equals running
    every block. That one run's figure is a probe of a model built at its depth, and the
    periods past the second each add the same bytes."""
    import tpplan.analysis.memory.per_rank as memory
    from tpplan.analysis.memory.step import first_forward_ends, forward_activations, trace_step

    runs = []

    def counting(spec, mesh, build, shape, depth, period, io=None):
        runs.append((depth, period))
        return first_forward_ends(spec, mesh, build, shape, depth, period, io)

    monkeypatch.setattr(memory, "first_forward_ends", counting)

    def both(result) -> None:
        spec, step = result.plan.spec, result.step

        def build():
            return build_model(spec.model, "meta")

        result.extra["both"] = [first_forward(spec, result.mesh, build, step, layers,
                                              "layers", cut) for cut in (True, False)]
        depth = runs[0][0]
        result.extra["apart"] = forward_activations(trace_step(
            spec, result.mesh, build, step, depth, first_forward=True))
        result.extra["ends"] = first_forward_ends(spec, result.mesh, build, step, depth, every)

    ac = "{mode: none}" if every == 1 else f"{{mode: selective, every: {every}}}"
    overrides = [f"model.kwargs.n_layers={layers}", f"activation_checkpointing={ac}",
                 "train.seq_len=8", "train.micro_batch_size=1", "train.global_batch_size=6"]
    result = dry_run(str(PLANS / "llama.yaml"), 4, overrides, [("both", both)])
    assert result.ok, (result.errors, result.analysis_errors)
    cut, every_block = result.extra["both"]
    assert cut == every_block > 0
    depth = layers % every + 4 * every
    assert runs == [(depth, every)], runs
    total, ends = result.extra["ends"]
    assert total == result.extra["apart"]
    assert len(ends) == 4 and 0 < ends[2] - ends[1] == ends[3] - ends[2], ends


def test_the_trace_mode_keys_two_calls_alike_only_where_pytorch_does():
    """The memory trace's fake mode builds its own dispatch-cache key for plain dense fake
    tensors (tpplan.analysis.fake.tensors): two argument lists get the same key only where
    PyTorch's own key is the same, and what it does not take (a dict, a real tensor) gets
    PyTorch's key."""
    import itertools

    import torch
    from torch._subclasses._fake_tensor_utils import _CacheKeyState
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tpplan.analysis.fake.tensors import TraceMode, fake_mode

    mode = fake_mode()
    assert isinstance(mode, TraceMode)
    with mode:
        base = torch.empty(4, 6)
        args = [
            (base,), (torch.empty(4, 6),), (base.t(),), (base[1:],), (base[:3],),
            (base.to(torch.bfloat16),), (torch.empty(4, 6, requires_grad=True),),
            (torch.empty(6, 4),), (base.view(6, 4),), (base.view(24),), (base[:, ::2],),
            (torch.empty(4, 6, dtype=torch.complex64).conj(),),
            (torch.empty(4, 6, dtype=torch.complex64),), (base, 1), (base, 1.0), (base, True),
            (base, [2, 3]), (base, (2, 3)), (base, [2, 3, 4]), (base, None), ([base, base],),
            ([base, base[1:]],), (base, torch.float32), (base, torch.bfloat16),
        ]

    def keys(own: bool, a) -> tuple:
        out: list = []
        prep = TraceMode._prep_args_for_hash if own else FakeTensorMode._prep_args_for_hash
        prep(mode, out, a, _CacheKeyState(), [])
        return tuple(out)

    ours = [keys(True, a) for a in args]
    theirs = [keys(False, a) for a in args]
    assert all(k[0] != t[0] for k, t in zip(ours, theirs))  # tagged: they never meet
    for i, j in itertools.combinations(range(len(args)), 2):
        assert (ours[i] == ours[j]) == (theirs[i] == theirs[j]), (i, j)
    assert len(set(ours)) >= len(args) - 2  # not a key that says little
    # A dict and a real tensor: PyTorch's key, as the plain mode builds it.
    with mode:
        t = torch.empty(2)
    assert keys(True, ({"a": 1}, t)) == keys(False, ({"a": 1}, t))


def test_the_trace_mode_takes_unsafe_view_and_a_meta_tensors_empty_like_from_its_cache():
    """Two ops PyTorch's fake mode passes its cache by, made cacheable as what they are:
    ``_unsafe_view`` (a view by its kernel: the output on its input's storage) and
    ``empty_like`` of a plain meta tensor (each parameter made fake: ``empty_strided`` of its
    shape and strides, where they are dense); the same tensors as PyTorch's mode makes, and
    a meta tensor whose strides are not dense takes PyTorch's path."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tpplan.analysis.fake.tensors import fake_mode

    dense = torch.empty(6, 4, device="meta").t()  # strides (1, 4): dense, not contiguous
    gappy = torch.empty(6, 8, device="meta")[:, ::2]  # not dense
    made, counts = {}, {}
    for name, mode in (("ours", fake_mode(allow_non_fake_inputs=True)),
                       ("theirs", FakeTensorMode(allow_non_fake_inputs=True))):
        with mode:
            x = torch.empty(4, 6)
            rounds = []
            for _ in range(2):
                hits = FakeTensorMode.cache_hits
                bypasses = sum(FakeTensorMode.cache_bypasses.values())
                v = torch.ops.aten._unsafe_view(x, [3, 8])
                e = torch.empty_like(dense, device="cpu")
                g = torch.empty_like(gappy, device="cpu")
                rounds.append((FakeTensorMode.cache_hits - hits,
                               sum(FakeTensorMode.cache_bypasses.values()) - bypasses))
                assert v.untyped_storage()._cdata == x.untyped_storage()._cdata
            made[name] = [(tuple(t.shape), t.stride(), t.dtype, t.device) for t in (v, e, g)]
        counts[name] = rounds[1]  # (cache hits, bypasses) of the second round
    assert made["ours"] == made["theirs"]
    # ours: the two served from the cache where PyTorch's mode passes them by
    assert counts["theirs"][1] == 3 and counts["ours"][1] == 1  # the gappy one's
    assert counts["ours"][0] >= 2
    assert made["ours"][1][1] == (1, 4) and made["ours"][2][1] == (4, 1)


@pytest.mark.parametrize("overrides", [
    ["mesh={dp_shard: 2, tp: 2}", "activation_checkpointing={mode: selective, every: 2}"],
    ["mesh={dp_replicate: 2, dp_shard: 2, tp: 1}", "train.micro_batch_size=3"],
])
def test_a_step_traced_in_the_trace_mode_equals_one_in_pytorchs_fake_mode(overrides,
                                                                         monkeypatch):
    """The same step, traced with the trace mode's cache key and with PyTorch's own
    ``FakeTensorMode``: every moment equal."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import tpplan.analysis.memory.step as steptrace
    from tpplan.analysis.memory.step import trace_step

    def both(result) -> None:
        spec, step = result.plan.spec, result.step

        def build():
            return build_model(spec.model, "meta")

        result.extra["ours"] = trace_step(spec, result.mesh, build, step)
        with monkeypatch.context() as m:
            m.setattr(steptrace, "fake_mode", lambda **kw: FakeTensorMode(**kw))
            result.extra["theirs"] = trace_step(spec, result.mesh, build, step)

    result = dry_run(str(PLANS / "llama.yaml"), 4, [
        "model.kwargs.n_layers=3", "train.seq_len=8", "train.global_batch_size=12", *overrides],
        [("both", both)])
    assert result.ok, (result.errors, result.analysis_errors)
    ours, theirs = result.extra["ours"], result.extra["theirs"]
    assert ours.keys() == theirs.keys() and len(ours) > 10
    for label in ours:
        assert ours[label].to_json() == theirs[label].to_json(), label


def test_a_cut_copy_is_the_model_built_and_cut_and_traces_the_same():
    """``ModelBuilder(make)(depth)``: a copy of one model made once, holding only its first
    ``depth`` blocks: the parameters (names, shapes, dtypes) and buffers of the model built
    afresh and cut there, the model it copies from left whole and untouched by the copy's
    changes; a deep model's memory traced from such copies equals one traced from fresh
    builds, moment for moment."""
    from tpplan.analysis.memory.step import ModelBuilder, truncated

    def both(result) -> None:
        spec, step = result.plan.spec, result.step

        def make():
            return build_model(spec.model, "meta")

        builder = ModelBuilder(make)
        cut = builder(4)
        fresh = make()
        fresh.layers = truncated(fresh.layers, 4)
        shapes = lambda m: [(n, tuple(t.shape), t.dtype) for n, t in m.state_dict().items()]  # noqa: E731
        assert shapes(cut) == shapes(fresh) and len(cut.layers) == 4
        cut.layers[0].attention.wq.weight.requires_grad_(False)
        assert builder.read(lambda m: (len(m.layers), m.layers[0].attention.wq.weight
                                       .requires_grad)) == (len(result.model.layers), True)
        n = len(result.model.layers)
        result.extra["copied"] = memory_per_rank(spec, result.mesh, builder, step, n, "layers")
        result.extra["built"] = memory_per_rank(spec, result.mesh, make, step, n, "layers")

    result = dry_run(str(PLANS / "llama.yaml"), 4, [
        "model.kwargs.n_layers=20", "train.seq_len=8", "train.global_batch_size=8",
        "mesh={dp_shard: 2, tp: 2}"], [("both", both)])
    assert result.ok, (result.errors, result.analysis_errors)
    copied, built = result.extra["copied"], result.extra["built"]
    assert copied["traced"]["depths"] == built["traced"]["depths"] == [4, 5, 6]
    assert copied == built
