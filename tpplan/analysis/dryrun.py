"""The dry run behind ``tpplan validate``: any world size, one process, no real memory.

The model is built on the meta device (shapes, no storage) and the process group is
PyTorch's ``fake`` backend (collectives return at once), so a 4,096-rank mesh costs what a
laptop has. The plan goes through the very ``plan.apply`` the trainer uses, and the step
it sizes is the one the trainer runs (:meth:`tpplan.Plan.step_shape`).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..api import Plan, load
from ..checkpoint import checkpoint_bytes
from ..models import build_model
from ..parallel.lora.sizes import checkpointed
from ..plan import ErrorList, PlanError, PlanErrors, StepShape, step_shape
from .fake.experts import sized
from .fake.group import ChunksOnDemand, fake_process_group, forget_meshes
from .moduletable import applied_report

__all__ = ["Analysis", "AnalysisError", "ChunksOnDemand", "DryRun", "MAX_WORLD_SIZE", "dry_run",
           "fake_process_group", "forget_meshes", "run_analysis", "world_size_problem"]

MAX_WORLD_SIZE = 2**31 - 1  # c10d's ProcessGroup keeps its size in a C int
# What the fake process group and the DeviceMesh hold per rank (a rank map and the mesh's
# rank tensor): about 800 bytes measured at 1M and 4M ranks, rounded up.
BYTES_PER_RANK = 1024


@dataclass
class AnalysisError:
    """An analysis that could not run on this plan and model, and why."""

    analysis: str
    message: str

    def to_json(self) -> dict[str, str]:
        return {"analysis": self.analysis, "message": self.message}


@dataclass
class DryRun:
    """The outcome of a dry run: the plan's errors, or the applied plan's report, the step
    it was sized for and each analysis's figures (or its :class:`AnalysisError`)."""

    world_size: int
    plan: Plan | None = None
    errors: list[PlanError] = field(default_factory=list)
    analysis_errors: list[AnalysisError] = field(default_factory=list)
    report: Any = None  # ApplyReport
    resolution: Any = None  # the plan resolved against the model (Resolution)
    model: Any = None  # the meta model
    # whether ``model`` itself was parallelized (the module table's, where its rows could
    # not come from a cut copy: tpplan.analysis.moduletable); never with apply=False
    parallelized: bool = False
    mesh: Any = None
    step: StepShape | None = None
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)  # each analysis's figures, by name
    tp_trace: Any = None  # the TP collectives of one micro-batch (TPTrace), when traced
    # One training checkpoint on disk, all ranks together: what `tpplan train`'s preflight
    # checks free space against (parameters + AdamW's two moments, from global shapes).
    checkpoint_bytes: int | None = None

    @property
    def ok(self) -> bool:
        return not self.errors and not self.analysis_errors

    @property
    def resolved(self) -> Any:
        """The resolution the plan was applied with (the report's), or the checked one when
        the plan was not applied (``apply=False``, ``search``): the same rules and units."""
        return self.report.resolution if self.report is not None else self.resolution

    @functools.cached_property
    def fsdp_units(self) -> list:
        """The plan's FSDP2 parameter groups (``UnitSize``, from shapes: the same on the
        applied model or the one not yet parallelized), computed once for every analysis
        that needs them."""
        from ..parallel.fsdp_units import unit_sizes

        res = self.resolved
        return unit_sizes(self.model, res, res.dims, self.plan.spec)

    def to_json(self) -> dict[str, Any]:
        dims = self.resolved.dims if self.resolved is not None and not self.errors else None
        out = {
            "ok": self.ok,
            "errors": [e.to_json() for e in self.errors],
            "analysis_errors": [e.to_json() for e in self.analysis_errors],
            "world_size": self.world_size,
            "mesh": dims.as_dict() if dims else None,
            "step": self.step.to_json() if self.step else None,
            "checkpoint_bytes": self.checkpoint_bytes,
            "modules": [m.to_json() for m in self.report.modules] if self.report else [],
        }
        out.update(self.extra)
        return out


# An analysis adds its figures to DryRun.extra under its name; it runs while the fake
# process group is up.
Analysis = tuple[str, Callable[[DryRun], None]]


def _available_memory() -> int | None:
    """Bytes of memory this machine can still give (Linux's MemAvailable), None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def world_size_problem(world_size: int) -> str | None:
    """Why the dry run cannot simulate ``world_size`` ranks (to follow "world size N ..."),
    or None. The limits are PyTorch's process group size, a C int, and this machine's
    memory: the fake group and the mesh hold about a kilobyte per rank."""
    if world_size < 1:
        return f"must be at least 1, got {world_size}"
    if world_size > MAX_WORLD_SIZE:
        return (f"{world_size:,} is more than a PyTorch process group can hold: at most "
                f"{MAX_WORLD_SIZE:,} ranks")
    need, free = world_size * BYTES_PER_RANK, _available_memory()
    if free is not None and need > free:
        return (f"{world_size:,} needs about {need / 2**30:,.1f} GiB of memory for the dry "
                f"run's fake process group and mesh (~{BYTES_PER_RANK} bytes per rank), and "
                f"this machine has {free / 2**30:,.1f} GiB available")
    return None


def run_analysis(result: DryRun, name: str, analysis: Callable[[DryRun], None]) -> None:
    """Run ``analysis`` on ``result``; an exception becomes the analysis's error (its
    reason in ``result.analysis_errors`` and under ``name``), never a traceback."""
    try:
        analysis(result)
    except PlanErrors as e:  # the plan's own mistake, found by running the model (a layout count)
        seen = {(x.loc, x.message) for x in result.errors}  # each analysis runs the model
        result.errors.extend(x for x in e.errors if (x.loc, x.message) not in seen)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - this analysis's error, with its reason
        # (a model whose forward calls sys.exit stops the analysis, not the command)
        reason = f"{type(e).__name__}: {e}".splitlines()[0]
        result.analysis_errors.append(AnalysisError(name, reason))
        result.extra[name] = {"error": reason}


def dry_run(plan_path: str, world_size: int, overrides: Sequence[str] = (),
            analyses: Sequence[Analysis] = (), apply: bool = True) -> DryRun:
    """Load, check and apply a plan at ``world_size`` on meta tensors, then run ``analyses``.

    Errors in the plan (its sections, its patterns against the model, its batch against the
    mesh) end the run as ``errors``; an analysis that fails is an ``analysis_errors`` entry
    with its reason, and the others still run. ``apply=False`` checks without applying
    (no module table): enough for the memory analysis, which applies the plan itself.
    """
    problem = world_size_problem(world_size)
    if problem:
        raise ValueError(f"world size {problem}")
    start = time.perf_counter()
    result = DryRun(world_size)
    try:
        plan = result.plan = load(plan_path, overrides)
        model = build_model(plan.require_model(), device="meta")
        result.checkpoint_bytes = checkpoint_bytes(model, saved=checkpointed(plan.spec.lora,
                                                                            model))
        res = result.resolution = plan.resolve(model, world_size)
        errs = ErrorList(res.errors)
        if res.dims is not None:
            result.step = step_shape(plan.spec, res.dims.dp, res.dims.tp, errs)
        errs.raise_if_any()
        with fake_process_group(world_size):
            result.mesh = res.dims.build_mesh("cpu")
            result.model = model
            if apply:  # the module table; the model itself parallelized only where needed
                result.report, result.parallelized = applied_report(plan, model, res,
                                                                    result.mesh)
            for name, analysis in analyses:
                run_analysis(result, name, analysis)
            if sized():  # the report says what balanced routing sized (fake/experts.py)
                result.extra["balanced_experts"] = sized()
    except PlanErrors as e:
        result.errors = e.errors
    result.seconds = time.perf_counter() - start
    return result
