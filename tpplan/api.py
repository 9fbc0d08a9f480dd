"""The public façade: :func:`load` a plan, then act on a model with :class:`Plan`'s methods.

A :class:`Plan` holds the parsed :class:`~tpplan.plan.specs.PlanSpec` (its sections read as
``plan.mesh``, ``plan.fsdp``, ``plan.train``, ...) and hands it to the layers below, which
take specs and return results; only this façade keeps state (:attr:`Plan.last_report`).
Reading a plan imports no model and needs no GPU; torch is imported only by the methods
that build a mesh or touch a model.
"""

from __future__ import annotations

import contextlib
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from .plan import ErrorList, PlanSpec, StepShape, read_plan, step_shape
from .plan.yamlio import LMap, plain

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch.nn as nn
    from torch.distributed.device_mesh import DeviceMesh

    from .parallel.mesh import ParallelDims
    from .plan.specs import ModelSpec
    from .parallel.report import ApplyReport
    from .parallel.pipeline.stages import Pipeline
    from .parallel.resolve import Resolution

__all__ = ["Plan", "load"]

# What reads straight off the spec: every PlanSpec field, and its derived properties.
SECTIONS = frozenset(f.name for f in fields(PlanSpec)) | {"uses_sequence_parallel"}


class Plan:
    """A parallel plan. Build one with :func:`tpplan.load`.

    Example::

        >>> plan = tpplan.load("plans/llama.yaml", overrides=["mesh.tp=4"])
        >>> mesh = plan.build_mesh()                 # ([pp,] dp_replicate, dp_shard, tp)
        >>> model = plan.apply(model, mesh)          # TP -> AC -> compile -> FSDP2
        >>> with plan.loss_context():
        ...     loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        ...     loss.backward()
        >>> print(plan.last_report)                  # which rule hit which modules
    """

    def __init__(self, spec: PlanSpec, document: LMap | None = None):
        self.spec = spec
        self.document = document
        self.last_report: ApplyReport | None = None

    def __getattr__(self, name: str) -> Any:
        # The sections read straight off the spec: plan.mesh.tp, plan.train.seq_len, ...
        spec = self.__dict__.get("spec")
        if spec is not None and name in SECTIONS:
            return getattr(spec, name)
        raise AttributeError(f"'Plan' object has no attribute '{name}'")

    def require_model(self) -> "ModelSpec":
        """The ``model`` section; a located :class:`PlanErrors` when the plan has none."""
        from .plan.sections import require_model

        return require_model(self.spec)

    def section(self, name: str) -> LMap:
        """A section of the plan document as written (located), empty if absent. The typed
        form of every section is ``plan.<section>`` (``plan.train.seq_len``)."""
        value = self.document.get(name) if self.document is not None else None
        return value if isinstance(value, LMap) else LMap(self.mesh.loc)

    def parallel_dims(self, world_size: int) -> "ParallelDims":
        """The mesh degrees at this world size; :class:`PlanErrors` if it does not fit."""
        from .parallel.mesh import ParallelDims

        from .plan.styles import ep_borrows_tp

        return ParallelDims.of(self.spec.mesh, world_size, ep_borrows_tp(self.spec.rules))

    def step_shape(self, world_size: int) -> StepShape:
        """The optimizer step ``tpplan train`` runs at ``world_size`` (sequence length,
        micro-batch, gradient accumulation, dtypes); :class:`PlanErrors` when the ``train``
        batch does not split over the mesh."""
        dims = self.parallel_dims(world_size)
        errs = ErrorList()
        shape = step_shape(self.spec, dims.dp, dims.tp, errs)
        errs.raise_if_any()
        return shape

    def build_mesh(self, device_type: str | None = None) -> "DeviceMesh":
        """Start the process group if needed (gloo on CPU, nccl with GPUs; torchrun's env
        variables, or a single process) and build the named 3-D mesh."""
        from .parallel.runtime import default_device_type, ensure_process_group

        device_type = device_type or default_device_type()
        world = ensure_process_group(device_type)
        return self.parallel_dims(world).build_mesh(device_type)

    def resolve(self, model: "nn.Module", world_size: int, part: Any = None) -> "Resolution":
        """Match every pattern against ``model`` and run every check at ``world_size``.

        Needs no process group, so mistakes surface before any collective; with pipeline
        stages, each stage's forward runs on meta against the stage contract
        (docs/pipeline.md). The result has
        ``errors`` (empty when the plan fits) and which modules each rule, unit and
        attribute resolved to. ``part``: a cache of the resolution's parts across variants
        of one plan (``search``'s, :class:`tpplan.analysis.search.check_cache.PartCache`).
        """
        from .parallel.resolve import resolve
        from .plan.errors import run_part

        res = resolve(self.spec, model, world_size, part=part or run_part)
        if res.pipeline is not None and not res.errors:
            # the stage contract, run on meta (validate, verify and train all come here first)
            from .parallel.pipeline.contract import stage_contract

            res.errors.extend(stage_contract(model, res.pipeline, self.spec))
        return res

    def check(self, model: "nn.Module", world_size: int) -> "Resolution":
        """:meth:`resolve`, raising :class:`PlanErrors` when anything is wrong."""
        res = self.resolve(model, world_size)
        res.errors.raise_if_any()
        return res

    def apply(self, model: "nn.Module", mesh: "DeviceMesh") -> "nn.Module":
        """Parallelize ``model`` in place on ``mesh`` and return it.

        The order is fixed: tensor parallel rules, ``divide_by_tp``, activation
        checkpointing, compile, then FSDP2 units and the root. Works on a model built on
        the meta device (materialize it afterwards with ``model.to_empty(...)``).
        Raises :class:`PlanErrors` before touching the model if the plan does not fit.
        The report of what was applied is left in :attr:`last_report`.
        """
        from .models.moe_loss import gather_router_logits
        from .parallel.apply import apply_plan

        self.last_report = apply_plan(self.spec, model, mesh)
        gather_router_logits(model, self.last_report.router_shards)
        return model

    def apply_pipeline(self, model: "nn.Module", mesh: "DeviceMesh", loss_fn: "Callable | None",
                       device: Any = None, scale_grads: bool = True) -> "Pipeline":
        """This rank's pipeline stages of ``model`` and the schedule that runs them, for a
        plan with ``mesh.pp > 1`` and a ``pipeline`` section.

        ``model`` is the whole model, best built on the meta device (materialize the stages
        afterwards: ``for m in pipe.modules: m.to_empty(...)``); it is left whole. Each stage
        gets the same TP -> AC -> compile -> FSDP2 as :meth:`apply`, on this rank's slice of
        the mesh, then a ``PipelineStage``; the schedule calls ``loss_fn(output, target)`` on
        the last stage per micro-batch (call :meth:`Pipeline.step` inside
        :meth:`loss_context`). ``scale_grads`` (torch's default) divides gradients by the
        number of micro-batches, right for a ``loss_fn`` that returns a micro-batch's mean.
        The split contract a model must meet is in docs/pipeline.md.

        Example::

            >>> pipe = plan.apply_pipeline(model, mesh, loss_fn=cross_entropy)
            >>> with plan.loss_context():
            ...     pipe.step(tokens, target=targets, losses=losses)
            >>> optimizer.step()                          # over pipe.parameters()
        """
        from .parallel.pipeline.stages import apply_pipeline

        if self.spec.pipeline is None:
            from .plan import PlanError, PlanErrors

            raise PlanErrors([PlanError("apply_pipeline needs a plan with mesh.pp > 1 and a "
                                        "'pipeline' section; use apply()", self.mesh.loc)])
        pipe = apply_pipeline(self.spec, model, mesh, loss_fn, device, scale_grads)
        self.last_report = pipe.reports[0] if pipe.reports else None
        return pipe

    def loss_context(self) -> contextlib.AbstractContextManager:
        """``loss_parallel()`` when the plan shards the logits over tp, else a no-op."""
        from .parallel.apply import loss_context

        return loss_context(self.spec)

    def to_dict(self) -> dict[str, Any]:
        """The resolved plan (extends and overrides applied) as plain data, for a run folder.

        Relative paths (``model.hf_config``, ``model.pretrained``, the data's) are made
        absolute where the plan finds them: the copy lives in another folder."""
        out = plain(self.document) if self.document is not None else {}
        model = out.get("model")
        for key in ("hf_config", "pretrained"):
            if isinstance(model, dict) and isinstance(model.get(key), str):
                model[key] = str(self.model.path(model[key]).resolve())
        for section, key in (("data", "path"), ("data", "tokenizer"), ("eval", "path")):
            value = out.get(section, {}).get(key) if isinstance(out.get(section), dict) else None
            if isinstance(value, str):
                out[section][key] = str(Path(self.data.resolved(value)).resolve())
        return out


def load(path: str | Path, overrides: Sequence[str] = ()) -> Plan:
    """Read a plan file, follow its ``extends`` chain, apply ``key.path=value`` overrides.

    Every section is parsed, the trainer's included. Raises :class:`PlanErrors` (each error
    ``file:line:col: message``) for any mistake.

    Example::

        >>> plan = tpplan.load("plans/llama.yaml", overrides=["model.config=8b", "mesh.tp=8"])
    """
    doc, spec = read_plan(path, overrides)
    return Plan(spec, doc)

