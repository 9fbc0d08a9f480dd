"""Fault tolerance on torchft: replica groups that survive each other's failures.

``groups`` (where a replica group stands: its overrides, run folder, the extra's check; no
torch), ``replica`` (this rank's torchft Manager around the trainer's step: quorum, recovery
from a peer, the cross-group gradient all-reduce, the agreed commit), ``launch`` (the
lighthouse and one torchrun per group on one machine), ``torchrun`` (a group's torchrun, its
end an exit code rather than a traceback). Imports only the plan layer.
"""

from ..exports import lazy_exports

__all__, __getattr__ = lazy_exports(__name__, {
    "groups": ["ENV_CHECKPOINTS", "ENV_GROUP", "ENV_LIGHTHOUSE", "group_checkpoints", "group_index",
               "group_overrides", "group_run_dir", "missing_extra", "run_checkpoints"],
    "launch": ["lighthouse_argv", "start_groups", "start_lighthouse", "torchrun_argv"],
    "replica": ["Replica"],
})
