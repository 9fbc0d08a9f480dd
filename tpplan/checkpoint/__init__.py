"""The checkpoint layer: how a run's checkpoints are laid out on disk, written and read.

``sharded``: DCP checkpoints of a training run (``step-NNNNNN/`` folders, atomic, reshardable
onto another mesh), found by the trainer's ``--resume`` and by ``tpplan export`` alike.
Imports only the plan layer.
"""

from .sharded import (
    DIE_DURING_SAVE_ENV, TRAINER_FILE, find_checkpoint, is_complete, latest, load, model_shapes,
    read_model_state, read_trainer_state, save,
)

__all__ = ["DIE_DURING_SAVE_ENV", "TRAINER_FILE", "find_checkpoint", "is_complete", "latest",
           "load", "model_shapes", "read_model_state", "read_trainer_state", "save"]
