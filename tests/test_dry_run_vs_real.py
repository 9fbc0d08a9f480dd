"""``tpplan validate``'s memory and communication against the same step run for real.

Each case runs the plan's optimizer step the way ``tpplan train`` does on a gloo CPU mesh
(gradient accumulation with gradient sync off until the last micro-batch included) and
measures it: plain sums of the live local tensors (parameters, gradients, optimizer
state), saved-for-backward tensors through ``saved_tensors_hooks`` (each storage once),
and PyTorch's own ``FSDPMemTracker`` for the step's peak, the activations left at the end
of forward, FSDP2's unsharded parameters and the unsharded gradients it keeps between
micro-batches. The dry run predicts the same on fake tensors at the same world size.
Communication is held against ``tpplan train`` itself, run under a collective recorder.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
from helpers import PLANS
from memory_measure import CASES, compare, measure_worker, trainer_collectives_worker

from tpplan.analysis import ANALYSES
from tpplan.analysis.dryrun import dry_run
from tpplan.parallel.runtime import spawn

MEMORY = [a for a in ANALYSES if a[0] == "memory_per_rank"]
COMM = [a for a in ANALYSES if a[0] == "comm_per_step"]

TOLERANCE = 0.10  # the issue's bar; the figures in docs/dry-run.md are much closer


@pytest.mark.parametrize("name", list(CASES))
def test_memory_per_part_and_peak_match_a_real_step(name, tmp_path):
    plan, world, overrides = CASES[name]
    predicted = dry_run(str(PLANS / plan), world, overrides, MEMORY)
    assert predicted.ok, (predicted.errors, predicted.analysis_errors)
    spawn(measure_worker, world, str(PLANS / plan), overrides, str(tmp_path))
    measured = json.loads((tmp_path / "measured.json").read_text())
    rows = compare(predicted.extra["memory_per_rank"], measured)
    off = [r for r in rows if abs(r["ratio"] - 1) > TOLERANCE]
    assert not off, "\n".join(f"{r['part']}: predicted {r['predicted']}, measured "
                              f"{r['measured']}" for r in off)
    assert {r["part"] for r in rows} >= {"parameters", "buffers", "optimizer", "gradients",
                                         "fsdp_unsharded", "accumulated_gradients",
                                         "activations", "peak"}


BF16 = "fsdp.mixed_precision={param_dtype: bfloat16, reduce_dtype: float32}"


@pytest.mark.parametrize("extra", [
    [], [BF16],
    # LoRA: frozen units reduce nothing; the adapters' gradients are reduce-scattered, and
    # all-reduced over tp (a replicated A under a colwise base, B under a rowwise one)
    ['lora={targets: ["layers.*.attention.{wq,wv}", "layers.*.feed_forward.w2"], rank: 8, '
     'modules_to_save: [output]}', BF16],
    # adapters in the last blocks only: backward never reaches the embedding and block 0
    # (block 1 is gathered all the same: block 2's backward prefetches it)
    ['lora={targets: ["layers.{2,3}.attention.{wq,wv}"], rank: 4}'],
    ['freeze=[tok_embeddings, "layers.0"]'],
], ids=["fp32", "bf16", "lora", "lora-last-blocks", "freeze"])
def test_communication_with_accumulation_is_what_tpplan_train_issues(extra, tmp_path):
    """Two micro-batches per step: TP collectives run per micro-batch, gradient reductions
    (FSDP2's reduce-scatter, sequence-parallel norm weights' all-reduce) once per step, for
    the parameters that train only."""
    world = 4
    overrides = ["train.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=8",
                 "train.steps=1", "checkpoint.enabled=false", "data.max_bytes=20000",
                 f"metrics.run_dir={tmp_path / 'run'}", *extra]
    predicted = dry_run(str(PLANS / "llama.yaml"), world, overrides, COMM)
    assert predicted.ok, (predicted.errors, predicted.analysis_errors)
    assert predicted.step.grad_accum == 2
    spawn(trainer_collectives_worker, world, str(PLANS / "llama.yaml"), overrides,
          str(tmp_path))
    real_count, real_bytes = Counter(), Counter()
    collectives = json.loads((tmp_path / "collectives.json").read_text())
    for dim, kind, nbytes, phase in collectives:
        # The trainer's own bookkeeping is not the plan's communication: the gradient
        # norm for clipping (after the last backward) and the loss it logs (after the
        # optimizer step). They are a few small all-reduces.
        if phase != "step":
            assert kind == "all_reduce" and nbytes < 1024, (dim, kind, nbytes, phase)
            continue
        real_count[(dim, kind)] += 1
        real_bytes[(dim, kind)] += nbytes
    rows = predicted.extra["comm_per_step"]["collectives"]
    assert {(r["mesh_dim"], r["kind"]): r["count"] for r in rows} == real_count
    assert {(r["mesh_dim"], r["kind"]): r["bytes"] for r in rows} == real_bytes
