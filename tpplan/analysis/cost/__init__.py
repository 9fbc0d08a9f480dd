"""The estimated step time of a plan on a device (docs/search.md).

- ``step_time``: compute, communication and bubble, with the cost model's constants.
- ``flops``: model FLOPs per token, counted from the model itself.
- ``gemm``: a GEMM's efficiency from its shape.
- ``collectives``: the α–β time of a collective, all-to-all and ring attention, per link.
- ``schedule``: a pipeline schedule as data: order, micro-batches in flight, bubble.
- ``calibration``: the constants fitted to step times a user measured.
"""

from ...exports import lazy_exports

__all__, __getattr__ = lazy_exports(__name__, {
    "flops": ["model_flops"],
    "step_time": ["DEFAULT_CONSTANTS", "CostConstants", "StepEstimate", "estimate_step"],
})
