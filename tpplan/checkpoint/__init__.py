"""The checkpoint layer: how a run's checkpoints are laid out on disk, written, verified and
read.

``sharded``: DCP checkpoints of a training run (``step-NNNNNN/`` folders, atomic, reshardable
onto another mesh), found by the trainer's ``--resume`` and by ``tpplan export`` alike.
``integrity``: the manifest of sizes and SHA-256s written with each checkpoint and checked on
load, and the trainer state as JSON (no pickle, so loading a checkpoint cannot run code).
Imports only the plan layer.
"""

from .integrity import Damaged, check_contents, check_structure
from .sharded import (
    TRAINER_FILE, SaveFailed, checkpoint_bytes, complete_checkpoints,
    find_checkpoint, is_complete, is_step_folder, latest, load, model_shapes, read_model_state,
    read_trainer_state, save, step_of,
)

__all__ = ["TRAINER_FILE", "Damaged", "SaveFailed", "check_contents",
           "check_structure", "checkpoint_bytes", "complete_checkpoints", "find_checkpoint",
           "is_complete", "is_step_folder", "latest", "load", "model_shapes", "read_model_state",
           "read_trainer_state", "save", "step_of"]
