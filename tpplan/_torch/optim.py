"""The optimizer's lazy state initialization.

Checked on torch 2.11 through 2.14.1: ``Adam._init_group(group, params_with_grad, grads,
exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps)`` (``AdamW`` inherits it) makes the
state of each parameter with a gradient, as a first ``step`` does.
"""

from __future__ import annotations

import torch

__all__ = ["init_group_state"]


def init_group_state(optimizer: torch.optim.Optimizer, group: dict) -> None:
    """Make ``optimizer``'s state for ``group``'s parameters that have a gradient, as its
    first step would, without stepping: ``optimizer._init_group`` with six fresh lists (the
    outputs it fills, unused here)."""
    optimizer._init_group(group, [], [], [], [], [], [])
