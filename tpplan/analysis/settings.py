"""What one step looks like, read defensively from the plan's ``train`` section.

The trainer owns ``train``; the analyses only read the batch shape from it, under the names
it uses today and a few aliases, with defaults when a key is missing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["StepShape", "step_shape", "DTYPES"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class StepShape:
    """One rank's micro-batch and how many of them make an optimizer step."""

    seq_len: int
    micro_batch: int  # sequences per data-parallel rank per forward
    grad_accum: int  # micro-batches per optimizer step
    param_dtype: torch.dtype  # what forward/backward compute in (FSDP mixed precision)
    reduce_dtype: torch.dtype  # what gradients are reduced in


def _int(section, *names: str, default: int) -> int:
    for name in names:
        value = section.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return default


def step_shape(plan, dp: int) -> StepShape:
    """``seq_len`` (default 2048), ``micro_batch_size`` (default 1) and gradient accumulation:
    ``gradient_accumulation_steps`` if given, else ``global_batch_size / (micro × dp)`` when
    that divides, else 1."""
    train = plan.section("train")
    seq_len = _int(train, "seq_len", "seq_length", "sequence_length", default=2048)
    micro = _int(train, "micro_batch_size", "local_batch_size", "batch_size", default=1)
    accum = _int(train, "gradient_accumulation_steps", "grad_accum_steps", "grad_accum",
                 default=0)
    if not accum:
        global_batch = _int(train, "global_batch_size", default=0)
        per_pass = micro * dp
        accum = global_batch // per_pass if global_batch and global_batch % per_pass == 0 else 1
        accum = max(accum, 1)
    fsdp = plan.fsdp
    param = DTYPES.get(fsdp.param_dtype) if fsdp and fsdp.param_dtype else torch.float32
    reduce = DTYPES.get(fsdp.reduce_dtype) if fsdp and fsdp.reduce_dtype else param
    return StepShape(seq_len, micro, accum, param, reduce)
