"""AdamW's state made before its first step, as that step would make it.

The trainer's measured CPU step (:mod:`tpplan.train.memwatch`) and the dry run's traced
step (:mod:`tpplan.analysis.memory.step`) both start with the state every later step holds;
the checkpoint layer is where optimizer state is known to both.
"""

from __future__ import annotations

import torch

from .._torch.optim import init_group_state

__all__ = ["init_state"]


def init_state(optimizer: torch.optim.Optimizer) -> None:
    """Make AdamW's state as its first ``step`` makes it (its lazy initialization: zero
    moments, step 0, for every parameter that trains), without stepping: the values are
    the ones that step would make, so training is unchanged. The dry run's trace starts its
    step this way, and so does the step the trainer measures on CPU (``memwatch``)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for p in params:  # a gradient marks a parameter as one AdamW's step updates
        p.grad = torch.zeros_like(p)
    with torch.no_grad():
        for g in optimizer.param_groups:
            init_group_state(optimizer, g)
    optimizer.zero_grad(set_to_none=True)
