"""The non-GEMM term's kernel traces, shared between the candidates of one search.

``search`` prices each candidate that reaches its communication stage with the step's
memory-bound kernels (:func:`tpplan.analysis.analyses.analyze_kernels`: the trainer's step on
fake tensors, every operator counted, :func:`tpplan.analysis.memory.kernels.kernel_profile`).
Two candidates whose traces would run the same operators on the same local shapes share
one: :class:`KernelCache` is a ``kernel_profile`` that remembers, keyed by everything the
trace reads that differs between the candidates of one plan:

- the mesh, every degree (``dp_shard`` sizes FSDP2's shards, AdamW's update over them and
  the copies in and out of its collectives; ``dp_replicate``, ``pp``, ``cp``, ``ep``,
  ``ep_borrows_tp`` how the plan is applied), and the context-parallel method where there is cp;
- the step's shape as the trace runs it: seq_len, micro-batch, the micro-batches traced
  (``min(accumulation, 3)``: the first, middle and last; whether gradient sync is switched
  off between them), dtypes; the accumulation itself only weights the traced micro-batches
  (the profile's ``accum``, put back per candidate);
- activation checkpointing (mode, period, blocks) and the traced depths' inputs (the
  model's repeated blocks and how many);
- under a pipeline, the stage: the blocks and extras it owns of the one model and its ends
  (first, last, what it receives); the activation it sends is kept with the profile.

The rest of the plan (the model, the loss and its chunking, the optimizer) is the search's
own, the same in every candidate. The schedule and its micro-batch count are not read by a
stage's trace (the pp ranks' stages are combined per candidate by ``analyze_kernels``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

from ..analyses import analyze_kernels
from ..dryrun import DryRun
from ..memory.kernels import kernel_profile
from ..memory.step_loop import micro_batches_traced

__all__ = ["KernelCache"]


class KernelCache:
    """``cache(result)``: :func:`~tpplan.analysis.analyses.analyze_kernels` of ``result``
    with each (stage's) profile traced once per key (the module docstring); ``traces``
    counts ``kernels`` (traced) and ``kernels_cached``. ``profile``: what traces one
    (:func:`~tpplan.analysis.memory.kernels.kernel_profile`)."""

    def __init__(self, traces: Counter | None = None, profile: Callable[..., dict[str, Any]] = kernel_profile):
        self.entries: dict[tuple, tuple[dict[str, Any], tuple | None]] = {}
        self.traces = Counter() if traces is None else traces
        self.profile = profile

    def __call__(self, result: DryRun) -> None:
        dims, spec = result.resolution.dims, result.plan.spec
        cp = spec.context_parallel
        ac = spec.activation_checkpointing
        common = (dims, (cp.method, cp.load_balance) if dims.cp > 1 else None,
                  ac.enabled, ac.mode, ac.every, ac.blocks)

        def cached(spec, mesh, build, shape, n_blocks: int, blocks: str | None, io=None) -> dict[str, Any]:
            stage = io and (io.first, io.last, io.received, build.stage.blocks, build.stage.extras)
            key = (*common, shape.seq_len, shape.micro_batch, micro_batches_traced(shape.grad_accum),
                   shape.param_dtype, shape.reduce_dtype, n_blocks, blocks, stage)
            if key in self.entries:
                self.traces["kernels_cached"] += 1
            else:
                self.traces["kernels"] += 1
                self.entries[key] = (self.profile(spec, mesh, build, shape, n_blocks, blocks, io=io),
                                     io.sent if io else None)
            out, sent = self.entries[key]
            if io is not None:
                io.sent = sent
            return dict(out, accum=shape.grad_accum)  # the traces are shared, read only

        analyze_kernels(result, cached)
