"""Expert parallelism (docs/moe.md): a mixture-of-experts layer's routed experts spread over
``mesh.ep``, tokens routed to them by all-to-all.

- ``style``: the ``expert_parallel`` style: which experts each ep rank keeps (DTensors
  ``Shard(0)`` under their full-model names), the dropless dispatch and combine (even,
  without reading the ids, inside ``balanced_routing``: the dry run's choice).
- ``forms``: the experts modules it takes: grouped weights ``[E, ...]``, how they are called,
  Llama 4's dense dispatch.
- ``module_list``: a ``ModuleList`` of per-expert modules: each rank keeps its experts under
  their global names.
- ``sequence_local``: a MoE block run on each tp rank's own sequence shard, its weights'
  gradients summed over tp.
"""

from ...exports import lazy_exports

__all__, __getattr__ = lazy_exports(__name__, {
    "module_list": ["check_expert_list", "split_expert_list"],
    "sequence_local": ["SequenceLocal", "check_sequence_local"],
    "style": ["ExpertParallel", "balanced_routing", "check_expert_parallel", "dispatch_counts",
              "routed_forward"],
})
