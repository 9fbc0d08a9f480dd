"""The memory trace's own promises: tracing a deep model at three shallow depths and
extrapolating gives what tracing every block gives, moment for moment."""

from __future__ import annotations

import pytest
from helpers import PLANS

from tpplan.analysis.dryrun import dry_run
from tpplan.analysis.memory import first_forward, memory_per_rank
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
def test_a_first_forward_at_three_depths_equals_running_every_block(every, layers, monkeypatch):
    """The first forward (the memory floor's probe) run at three shallow depths and
    extrapolated equals running every block, where k divides the depth and where it
    leaves a remainder (13 blocks, every second checkpointed: depths 1, 3, 5; 20 blocks,
    every third: 2, 5, 8). The three shallow ones share one model, warmed up once at the
    deepest: each equals a probe of a model built at its own depth."""
    import tpplan.analysis.memory as memory
    from tpplan.analysis.steptrace import first_forwards, forward_activations, trace_step

    depths = []

    def counting(spec, mesh, build, shape, ds, io=None):
        depths.append(ds)
        return first_forwards(spec, mesh, build, shape, ds, io)

    monkeypatch.setattr(memory, "first_forwards", counting)

    def both(result) -> None:
        spec, step = result.plan.spec, result.step

        def build():
            return build_model(spec.model, "meta")

        result.extra["both"] = [first_forward(spec, result.mesh, build, step, layers,
                                              "layers", cut) for cut in (True, False)]
        result.extra["apart"] = [forward_activations(trace_step(
            spec, result.mesh, build, step, d, first_forward=True)) for d in depths[0]]
        result.extra["shared"] = first_forwards(spec, result.mesh, build, step, depths[0])

    ac = "{mode: none}" if every == 1 else f"{{mode: selective, every: {every}}}"
    overrides = [f"model.kwargs.n_layers={layers}", f"activation_checkpointing={ac}",
                 "train.seq_len=8", "train.micro_batch_size=1", "train.global_batch_size=6"]
    result = dry_run(str(PLANS / "llama.yaml"), 4, overrides, [("both", both)])
    assert result.ok, (result.errors, result.analysis_errors)
    cut, every_block = result.extra["both"]
    assert cut == every_block > 0
    start = layers % every or every
    assert depths == [[start, start + every, start + 2 * every]], depths
    apart = result.extra["apart"]
    assert result.extra["shared"] == apart and apart[0] < apart[1] < apart[2], apart
