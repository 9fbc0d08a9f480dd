"""Pipeline schedules' tables of actions, read without stages or process groups.

Checked on torch 2.11 through 2.14.1. A multi-stage schedule computes each rank's actions
in ``_calculate_single_rank_operations(rank)`` from a few degrees its ``__init__`` sets from
the stages (``pp_group_size``, ``n_local_stages``, ``_n_microbatches``, ``_num_stages``,
``num_stages``, ``_stages``, ``number_of_rounds``, ``microbatches_per_round``,
``stage_index_to_group_rank``); zero-bubble schedules then pad it with
``_add_bubbles_to_actions(num_stages)``. ``_ComputationType`` names the action kinds and
``_utils.generate_stage_to_rank_mapping`` places stages on ranks.
"""

from __future__ import annotations

__all__ = ["computation_types", "schedule_table"]


def computation_types() -> list:
    """torch's action kinds (``pipelining.schedules._ComputationType``'s members)."""
    from torch.distributed.pipelining import schedules

    return list(schedules._ComputationType)


def schedule_table(torch_class: str, pp: int, v: int, m: int, v_shape: bool) -> dict[int, list]:
    """Each rank's actions of the schedule class ``torch_class`` (a name in
    ``torch.distributed.pipelining.schedules``) at ``pp`` ranks, ``v`` stages a rank and ``m``
    micro-batches; ``v_shape`` for V-shaped stage placement. The schedule is made with
    ``cls.__new__`` and given the degrees the table reads, nothing else."""
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    cls = getattr(schedules, torch_class)
    sched = cls.__new__(cls)  # the degrees the table reads, nothing else
    n = pp * v
    rounds = max(1, m // pp)
    style = "v" if v_shape else "loop"
    sched.__dict__.update(
        pp_group_size=pp, n_local_stages=v, _n_microbatches=m, _num_stages=n, num_stages=n,
        _stages=[None] * v, number_of_rounds=rounds, microbatches_per_round=m // rounds,
        stage_index_to_group_rank=generate_stage_to_rank_mapping(pp, n, style=style))
    sched.pipeline_order = {}
    for rank in range(pp):
        sched.rank = rank
        sched.pipeline_order[rank] = sched._calculate_single_rank_operations(rank)
    if hasattr(sched, "_add_bubbles_to_actions"):
        sched.pipeline_order = sched._add_bubbles_to_actions(n)
    return sched.pipeline_order
