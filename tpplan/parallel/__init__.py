"""The parallel layer: a :class:`~tpplan.plan.PlanSpec` applied to a model on a mesh.

``mesh`` (degrees, the DeviceMesh, data-parallel views), ``runtime`` (process groups,
spawning local ranks), ``resolve`` (patterns -> modules, every check that needs the model),
``apply`` (TP -> AC -> compile -> FSDP2), ``fsdp_units`` (the ``fully_shard`` calls and their
sizes), ``freeze``, ``report`` (what was applied) and ``meta_kernel_cache``; one package per
axis: ``tp/`` (tensor-parallel styles and the projections they split whole), ``experts/``
(expert parallelism), ``context/`` (context parallelism), ``lora/`` (adapters) and
``pipeline/`` (stages and schedules). Imports only the plan layer and ``tpplan._torch``.
"""
