"""Communication per optimizer step, and the minimum each axis needs.

- ``step``: TP (traced), FSDP (from its units) and the Megatron minimum, per step.
- ``counting``: collectives as the plan really issues them (CommDebugMode plus sizes).
- ``tp_trace``: TP collectives counted by running the TP forward and backward on meta.
- ``tp_model``: the meta model such a trace runs (the plan applied but FSDP), its groups named.
- ``tp_batch``: a TP trace extrapolated in the micro-batch (the search's).
- ``stage_bound``: a lower bound of each pp rank's TP collectives, no stage traced.
- ``stages``: per pp rank communication of a pipeline plan.
- ``context``: context parallelism's traffic against its method's minimum.
- ``experts``: expert memory per rank and the experts' all-to-all.
"""

from ...exports import lazy_exports

__all__, __getattr__ = lazy_exports(__name__, {
    "step": ["diagnose", "fsdp_collectives", "megatron_minimum"],
    "tp_trace": ["TPTrace", "trace_tp"],
})
