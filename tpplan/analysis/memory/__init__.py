"""Memory per rank (docs/dry-run.md): the trainer's step run on fake tensors, each storage it
allocates followed by part.

- ``per_rank``: the figures ``validate`` reports: parts, peak, depth extrapolation.
- ``step``: one optimizer step of ``tpplan train`` on fake tensors.
- ``step_loop``: that step's micro-batches, warm-up and AdamW, run under the tracker.
- ``tracker``: the dispatch mode that follows live storages by part.
- ``step_labels``: where the step is when memory is observed (micro-batch/pass/module).
- ``dp_shards``: one trace for every ``dp_shard`` (the search's).
- ``floor``: a lower bound of the peak from the first forward alone.
- ``stages``: per pp rank memory and p2p traffic of a pipeline plan.
- ``fit``: ``--device``: does it fit, and which checked changes make it fit.
"""

from ...exports import lazy_exports

__all__, __getattr__ = lazy_exports(__name__, {
    "fit": ["fit", "needed"],
    "per_rank": ["memory_per_rank"],
    "tracker": ["MemoryTracker"],
})
