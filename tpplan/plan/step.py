"""The shape of one optimizer step, as ``tpplan train`` runs it, from the plan's specs.

One function for the trainer and the dry run alike, so ``tpplan validate`` sizes memory
and communication for the batch ``tpplan train`` would really run, and refuses the batches
it would refuse. Pure arithmetic on the specs and the mesh degrees: no torch, no model.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ErrorList
from .specs import PlanSpec

__all__ = ["StepShape", "step_shape", "global_batch"]


@dataclass(frozen=True)
class StepShape:
    """One data-parallel rank's micro-batch and how many of them make an optimizer step."""

    seq_len: int
    global_batch: int  # sequences per optimizer step over all data-parallel ranks
    micro_batch: int  # sequences per data-parallel rank per forward
    grad_accum: int  # micro-batches per optimizer step
    param_dtype: str  # what forward/backward compute in (FSDP mixed precision), a dtype name
    reduce_dtype: str  # what gradients are reduced in

    def to_json(self) -> dict:
        return {"seq_len": self.seq_len, "global_batch_size": self.global_batch,
                "micro_batch_size": self.micro_batch, "grad_accum": self.grad_accum,
                "param_dtype": self.param_dtype, "reduce_dtype": self.reduce_dtype}


def _where(spec: PlanSpec, key: str):
    """The key's place in the plan, or the ``train`` section's when it was left out."""
    return spec.train.locs.get(key, spec.train.loc)


def _given(spec: PlanSpec, key: str) -> str:
    return "" if key in spec.train.locs else " (the default; set train." + key + ")"


def global_batch(spec: PlanSpec, dp: int, errs: ErrorList) -> int:
    """``train.global_batch_size``, or ``local_batch_size × dp`` when the plan gives the
    local one; both given must agree (else an error at ``local_batch_size``)."""
    t = spec.train
    if t.local_batch_size is None:
        return t.global_batch_size
    total = t.local_batch_size * dp
    if t.global_batch_size is not None and t.global_batch_size != total:
        errs.add(f"train.local_batch_size={t.local_batch_size} × dp={dp} is {total} sequences per "
                 f"step, but train.global_batch_size={t.global_batch_size}; give one of them (the "
                 "other follows from the mesh) or make them agree", _where(spec, "local_batch_size"))
        return t.global_batch_size
    return total


def _batch_text(spec: PlanSpec, total: int) -> str:
    t = spec.train
    if t.local_batch_size is not None:
        return f"train.local_batch_size={t.local_batch_size}"
    return f"train.global_batch_size={total}"


def _pipeline_micro(spec: PlanSpec, dp: int, total: int, errs: ErrorList) -> tuple[int, int]:
    """Under a pipeline the schedule's micro-batches are the accumulation: each data-parallel
    rank's share of the batch is cut into ``pipeline.microbatches`` equal parts."""
    t, pipe = spec.train, spec.pipeline
    per_rank, m = total // dp, pipe.microbatches
    if per_rank % m:
        whose = f"{_batch_text(spec, total)}" if t.local_batch_size is not None else \
            f"train.global_batch_size={total} over dp={dp}"
        errs.add(f"pipeline.microbatches={m} does not divide the {per_rank} sequences each "
                 f"data-parallel rank takes ({whose}); the schedule cuts them into equal "
                 "micro-batches",
                 pipe.locs.get("microbatches", pipe.loc))
        return max(per_rank // m, 1), m
    if t.micro_batch_size is not None and t.micro_batch_size != per_rank // m:
        errs.add(f"train.micro_batch_size={t.micro_batch_size} but under a pipeline the "
                 f"micro-batch is the rank's {per_rank} sequences over pipeline.microbatches={m}"
                 f" = {per_rank // m}; leave train.micro_batch_size out",
                 _where(spec, "micro_batch_size"))
    return per_rank // m, m


def step_shape(spec: PlanSpec, dp: int, tp: int, errs: ErrorList) -> StepShape:
    """The step at data-parallel degree ``dp`` and tensor-parallel degree ``tp``.

    ``micro_batch_size`` defaults to the whole per-rank batch (no accumulation); under a
    pipeline the per-rank batch is cut into ``pipeline.microbatches`` instead. The global
    batch must split evenly over ``dp``, each rank's share into whole micro-batches, and
    under sequence parallelism ``seq_len`` over ``tp``; mistakes go to ``errs``.
    """
    t = spec.train
    total = global_batch(spec, dp, errs)
    micro = t.micro_batch_size or max(total // dp, 1)
    accum = 1
    if spec.pipeline is not None and not total % dp:
        micro, accum = _pipeline_micro(spec, dp, total, errs)
    elif total % dp:
        low = total // dp * dp
        options = " or ".join(str(n) for n in (low, low + dp) if n > 0)
        errs.add(f"train.global_batch_size={total}{_given(spec, 'global_batch_size')}"
                 f" is not divisible by the data-parallel size {dp}; each data-parallel rank needs "
                 f"the same number of sequences (e.g. {options}), or give train.local_batch_size "
                 "(sequences per data-parallel rank) instead", _where(spec, "global_batch_size"))
    else:
        per_rank = total // dp
        if per_rank % micro:
            errs.add(f"{_batch_text(spec, total)} over dp={dp} is {per_rank} "
                     f"sequences per rank, not a multiple of train.micro_batch_size={micro} "
                     "(gradient accumulation needs whole micro-batches)",
                     _where(spec, "micro_batch_size"))
        else:
            accum = per_rank // micro
    cp = spec.mesh.cp
    chunks = spec.context_parallel.chunks(cp) if cp > 1 else 1
    if t.seq_len % chunks:
        how = (f"2·cp = {chunks} chunks (load balancing gives each rank a head and a tail "
               "chunk)" if spec.context_parallel.load_balance else f"cp={cp} ranks")
        errs.add(f"train.seq_len={t.seq_len}{_given(spec, 'seq_len')} is not divisible by "
                 f"cp={cp}: context parallelism cuts the sequence into {how}",
                 _where(spec, "seq_len"))
    elif spec.uses_sequence_parallel and (t.seq_len // cp) % tp:
        local = f" over cp={cp} ({t.seq_len // cp} tokens per rank)" if cp > 1 else ""
        errs.add(f"train.seq_len={t.seq_len}{_given(spec, 'seq_len')}{local} is not divisible "
                 f"by tp={tp}, which sequence parallelism needs (it splits the sequence over "
                 "the tp ranks)", _where(spec, "seq_len"))
    fsdp = spec.fsdp
    param = (fsdp.param_dtype if fsdp else None) or "float32"
    reduce = (fsdp.reduce_dtype if fsdp else None) or param
    return StepShape(t.seq_len, total, micro, accum, param, reduce)
