"""The parallel layer: a :class:`~tpplan.plan.PlanSpec` applied to a model on a mesh.

``mesh`` (degrees, the DeviceMesh, data-parallel views), ``runtime`` (process groups,
spawning local ranks), ``resolve`` (patterns -> modules, every check that needs the model),
``tp_styles`` (style specs -> PyTorch style objects), ``fsdp_units`` (the ``fully_shard``
calls and their sizes), ``apply`` (TP -> AC -> compile -> FSDP2) and ``report`` (what was
applied). Imports only the plan layer.
"""
