"""Pipeline stages on a mesh: this rank's stage modules, each parallelized by the plan, wrapped
in ``PipelineStage``, and the schedule that runs them (``torch.distributed.pipelining``).

The order is torchtitan's: split the whole (meta) model into stages first
(:func:`tpplan.parallel.pipeline.split.stage_module`), then run the one apply -- TP -> AC ->
compile -> FSDP2 -- on each stage over this rank's slice of the mesh without ``pp``
(``mesh["tp"]``, ``mesh["dp_shard"]``), then wrap each in a ``PipelineStage`` on the ``pp``
process group. The loss runs inside the schedule, on the last stage.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ...plan.pipeline import SCHEDULES
from ...plan.specs import PlanSpec
from ..apply import apply_plan
from .split import PipelineSplit, Stage, stage_module
from ..report import ApplyReport
from ..resolve import resolve

__all__ = ["Pipeline", "apply_pipeline", "build_schedule"]

log = logging.getLogger("tpplan")


@dataclass
class Pipeline:
    """What :meth:`tpplan.Plan.apply_pipeline` returns on one rank.

    ``modules`` are this rank's stage modules (parallelized; parameters under the whole
    model's names), ``stages`` their ``PipelineStage`` wrappers, ``schedule`` the
    ``torch.distributed.pipelining`` schedule that runs them. One training step::

        losses = []
        pipe.step(tokens if pipe.is_first else None, target=targets if pipe.is_last else None,
                  losses=losses)      # forward and backward of every micro-batch
        optimizer.step()              # over pipe.parameters()
    """

    schedule: object  # a torch.distributed.pipelining schedule
    stages: list  # PipelineStage, one per local stage, in pipeline order
    modules: list[nn.Module]
    split: PipelineSplit
    local: list[Stage]
    reports: list[ApplyReport] = field(default_factory=list)

    @property
    def is_first(self) -> bool:
        """This rank runs the first stage: it feeds the inputs."""
        return any(s.index == 0 for s in self.local)

    @property
    def is_last(self) -> bool:
        """This rank runs the last stage: it takes the targets and computes the loss."""
        return any(s.index == len(self.split.stages) - 1 for s in self.local)

    def parameters(self) -> Iterator[nn.Parameter]:
        for m in self.modules:
            yield from m.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for m in self.modules:
            yield from m.named_parameters()

    def step(self, *inputs, target=None, losses: list | None = None, **kwargs):
        """One forward and backward of every micro-batch: ``inputs`` on the first stage
        (pass nothing elsewhere), ``target`` on the last; each micro-batch's loss is appended
        to ``losses`` on the last stage. Returns the last stage's merged output there.

        ``kwargs`` (per-token tensors split into micro-batches along dim 0, like the inputs)
        reach every stage's forward: the tokens' positions (``positions`` for the built-in
        Llama, ``position_ids`` for HF), which a stage cannot derive from the hidden states
        it receives -- global positions under context parallelism, restarting ones for
        packed documents (:func:`tpplan.parallel.context.sequence.shard_batch` makes them)."""
        args = inputs if self.is_first else ()
        return self.schedule.step(*args, target=target if self.is_last else None,
                                  losses=losses if self.is_last else None, **kwargs)


def build_schedule(plan: PlanSpec, stages: list, loss_fn: Callable | None,
                   scale_grads: bool = True):
    """The plan's schedule over this rank's ``PipelineStage``\\ s."""
    from torch.distributed.pipelining import schedules

    pipe = plan.pipeline
    cls = getattr(schedules, SCHEDULES[pipe.schedule].torch_class)
    first = stages if SCHEDULES[pipe.schedule].multi else stages[0]
    return cls(first, n_microbatches=pipe.microbatches, loss_fn=loss_fn, scale_grads=scale_grads)


def apply_pipeline(plan: PlanSpec, model: nn.Module, mesh: DeviceMesh,
                   loss_fn: Callable | None, device: torch.device | str | None = None,
                   scale_grads: bool = True) -> Pipeline:
    """This rank's stages of ``model`` (best built on meta; it is left whole), parallelized,
    and the schedule; :class:`~tpplan.plan.errors.PlanErrors` before anything is built if
    the plan does not fit the model."""
    from torch.distributed.pipelining import PipelineStage

    res = resolve(plan, model, mesh.size())
    res.errors.raise_if_any()
    split = res.pipeline
    pp_mesh = mesh["pp"]
    local = split.of_rank(pp_mesh.get_local_rank())
    device = torch.device(device or mesh.device_type)
    modules, stages, reports = [], [], []
    for stage in local:
        module = stage_module(model, stage, split)
        reports.append(apply_plan(plan, module, mesh, stage=True))
        modules.append(module)
        stages.append(PipelineStage(module, stage.index, len(split.stages), device,
                                    group=pp_mesh.get_group()))
        log.info("pipeline stage %d of %d on pp rank %d: %s", stage.index, len(split.stages),
                 stage.rank, ", ".join(stage.modules))
    schedule = build_schedule(plan, stages, loss_fn, scale_grads)
    return Pipeline(schedule, stages, modules, split, local, reports)
