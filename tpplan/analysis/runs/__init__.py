"""Training runs as data (docs/training.md).

- ``report``: a run folder: its metrics over steps and the plan it ran, dry-run again.
- ``compare``: runs side by side: their curves, how their plans differ, where losses part.
- ``expected``: the dry run's figures a run is held to (handed to the trainer by the command).
"""

from ...exports import lazy_exports

__all__, __getattr__ = lazy_exports(__name__, {
    "compare": ["compare_runs"],
    "expected": ["estimate", "start_estimate"],
    "report": ["RunError", "run_metrics", "run_report"],
})
