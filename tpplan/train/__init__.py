"""``tpplan train``: TP + FSDP2 training from a plan, with resumable, reshardable checkpoints.

Built only on the public API (:func:`tpplan.load`, ``plan.build_mesh``, ``plan.apply``,
``plan.loss_context``), so a user's own loop can do everything this one does.
"""

from .loop import train
from .optim import clip_grad_norm, lr_lambda
from .setup import TrainError

__all__ = ["TrainError", "clip_grad_norm", "lr_lambda", "train"]
