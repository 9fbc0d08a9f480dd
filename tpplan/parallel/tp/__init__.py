"""Tensor parallelism: the styles a plan names, turned into ``torch.distributed.tensor.parallel``
objects, and the modules TP needs to know about to split them whole.

- ``styles``: a :class:`~tpplan.plan.styles.StyleSpec` -> PyTorch's style object (colwise, rowwise,
  sequence parallel, prepare_input/output, replicate).
- ``packed``: ``packed_colwise`` (fused QKV / gate-up projections) and ``experts_colwise_rowwise``.
- ``head_params``: per-head parameters an attention module uses itself (sinks, per-head scales).
- ``kv_heads``: key/value projections with fewer heads than tp, replicated per query group.
- ``latent``: multi-head latent attention's latent key/value projection.
- ``prepare_io``: ``prepare_input_output`` with its two repairs.
- ``attention``: attention computed on DTensors on CPU and on meta.
- ``sharding``: what a style splits of a module and the check that tp divides it.
- ``tied``: tied weights kept one weight through TP and pipeline stages.
- ``checks``: whole heads per rank, per-head norms beside colwise projections, tied weights.
"""

from ...exports import lazy_exports

__all__, __getattr__ = lazy_exports(__name__, {
    "checks": ["check_whole_model"],
    "head_params": ["HeadParamsParallel"],
    "kv_heads": ["KVColwiseParallel"],
    "latent": ["LatentKVParallel"],
    "packed": ["ExpertsColwiseRowwise", "PackedColwiseParallel"],
    "prepare_io": ["PrepareInputOutput"],
    "sharding": ["check_sharding", "shard_dims"],
    "styles": ["ReplicateParallel", "build_style"],
    "tied": ["retie", "tied_groups"],
})
