"""The Plan: a parsed plan file, and the public entry points that act on a model.

Reading a plan imports no model and needs no GPU; torch is imported only by the methods
that build a mesh or touch a model.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from .errors import ErrorList, PlanError, PlanErrors
from .loader import read_document
from .parallel_dims import ParallelDims
from .schema import (
    AttrRule, BlockSpec, FSDPSpec, MeshSpec, ModelSpec, Rule, TRAINER_SECTIONS, check_top_level,
    parse_blocks, parse_divide_by_tp, parse_fsdp, parse_mesh, parse_model, parse_rules,
)
from .yamlio import LMap, LSeq

if TYPE_CHECKING:
    import torch.nn as nn
    from torch.distributed.device_mesh import DeviceMesh

    from .report import ApplyReport
    from .resolve import Resolution

__all__ = ["Plan", "load", "from_document"]


@dataclass
class Plan:
    """A parallel plan. Build one with :func:`tpplan.load`.

    Example::

        >>> plan = tpplan.load("plans/llama.yaml", overrides=["mesh.tp=4"])
        >>> mesh = plan.build_mesh()                 # (dp_replicate, dp_shard, tp)
        >>> model = plan.apply(model, mesh)          # TP -> AC -> compile -> FSDP2
        >>> with plan.loss_context():
        ...     loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        ...     loss.backward()
        >>> print(plan.last_report)                  # which rule hit which modules
    """

    source: str
    mesh: MeshSpec
    model: ModelSpec | None
    rules: list[Rule]
    loss_parallel: bool = False
    divide_by_tp: list[AttrRule] = field(default_factory=list)
    fsdp: FSDPSpec | None = None
    activation_checkpointing: BlockSpec = field(default_factory=BlockSpec)
    compile: BlockSpec = field(default_factory=BlockSpec)
    document: LMap | None = None
    last_report: "ApplyReport | None" = None

    def section(self, name: str) -> LMap:
        """A section the trainer reads (``train``, ``data``, ``checkpoint``, ``metrics``),
        located, empty if absent."""
        value = self.document.get(name) if self.document is not None else None
        return value if isinstance(value, LMap) else LMap(self.mesh.loc)

    def parallel_dims(self, world_size: int) -> ParallelDims:
        """The mesh degrees at this world size; :class:`PlanErrors` if it does not fit."""
        try:
            return ParallelDims.solve(self.mesh.tp, self.mesh.dp_shard, self.mesh.dp_replicate,
                                      world_size)
        except ValueError as e:
            raise PlanErrors([PlanError(str(e), self.mesh.loc)]) from None

    def build_mesh(self, device_type: str | None = None) -> "DeviceMesh":
        """Start the process group if needed (gloo on CPU, nccl with GPUs; torchrun's env
        variables, or a single process) and build the named 3-D mesh."""
        from .runtime import default_device_type, ensure_process_group

        device_type = device_type or default_device_type()
        world = ensure_process_group(device_type)
        return self.parallel_dims(world).build_mesh(device_type)

    def resolve(self, model: "nn.Module", world_size: int) -> "Resolution":
        """Match every pattern against ``model`` and run every check at ``world_size``.

        Needs no process group, so mistakes surface before any collective. The result has
        ``errors`` (empty when the plan fits) and which modules each rule, unit and
        attribute resolved to.
        """
        from .resolve import resolve

        return resolve(self, model, world_size)

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
        from .apply import apply_plan

        return apply_plan(self, model, mesh)

    def loss_context(self) -> contextlib.AbstractContextManager:
        """``loss_parallel()`` when the plan shards the logits over tp, else a no-op."""
        if self.loss_parallel and self.mesh.tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def to_dict(self) -> dict[str, Any]:
        """The resolved plan (extends and overrides applied) as plain data, for a run folder.

        A relative ``model.hf_config`` is made absolute: the copy lives in another folder."""
        out = _plain(self.document) if self.document is not None else {}
        model = out.get("model")
        if isinstance(model, dict) and isinstance(model.get("hf_config"), str):
            base = Path(self.model.base_dir or ".")
            model["hf_config"] = str((base / model["hf_config"]).resolve())
        return out

    @property
    def uses_sequence_parallel(self) -> bool:
        return any(r.style.name == "sequence_parallel" for r in self.rules)


def _plain(value: Any) -> Any:
    if isinstance(value, LMap):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, LSeq):
        return [_plain(v) for v in value]
    return value


def from_document(doc: LMap, source: str = "<plan>") -> Plan:
    """Parse a located document; :class:`PlanErrors` lists every mistake at once."""
    errs = ErrorList()
    check_top_level(doc, errs)
    plan = Plan(
        source=source,
        mesh=parse_mesh(doc, errs),
        model=parse_model(doc, errs),
        rules=parse_rules(doc, errs),
        loss_parallel=doc.get("loss_parallel") is True,
        divide_by_tp=parse_divide_by_tp(doc, errs),
        fsdp=parse_fsdp(doc, errs),
        activation_checkpointing=parse_blocks(doc, "activation_checkpointing", errs),
        compile=parse_blocks(doc, "compile", errs),
        document=doc,
    )
    errs.raise_if_any()
    return plan


def load(path: str | Path, overrides: Sequence[str] = ()) -> Plan:
    """Read a plan file, follow its ``extends`` chain, apply ``key.path=value`` overrides.

    Raises :class:`PlanErrors` (each error ``file:line:col: message``) for any mistake.

    Example::

        >>> plan = tpplan.load("plans/llama.yaml", overrides=["model.config=8b", "mesh.tp=8"])
    """
    try:
        doc = read_document(path, overrides)
    except PlanError as e:
        raise PlanErrors([e]) from None
    return from_document(doc, str(path))


__all__ += ["TRAINER_SECTIONS"]
