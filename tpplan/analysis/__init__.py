"""The analysis layer: what a plan costs and whether it computes the right thing.

Imports the plan, models and parallel layers and the façade; not the trainer or byom.

- ``dryrun``: the plan applied at any world size on meta tensors and a fake process group.
- ``analyses``: the analyses ``tpplan validate`` runs (:data:`ANALYSES`), each adding its
  figures to ``DryRun.extra``; ``moduletable``: the module table.
- ``fake/``: the fake process group and fake tensors a dry run runs on.
- ``memory/``: memory per rank: the trainer's step on fake tensors, followed by part; fit.
- ``comm/``: communication per step: TP traced, FSDP from its units, pipeline, context, experts.
- ``cost/``: the estimated step time: FLOPs, GEMM efficiency, collectives, schedules, calibration.
- ``search/``: ``tpplan search``: candidate layouts, checked and ranked, with its caches.
- ``runs/``: run folders as data, runs side by side, the figures a run is held to.
- ``verify/``: ``tpplan verify``: a real run against one device, output by output.
"""

from ..exports import lazy_exports

__all__, __getattr__ = lazy_exports(__name__, {
    "analyses": ["ANALYSES", "analyze_memory", "analyze_comm", "fsdp_rows", "traced_rows", "compute_dtypes",
                 "model_blocks"],
})
