"""The dry run behind ``tpplan validate``: any world size, one process, no real memory.

The model is built on the meta device (shapes, no storage) and the process group is
PyTorch's ``fake`` backend (collectives return at once), so a 4,096-rank mesh costs what a
laptop has. The plan goes through the very ``plan.apply`` the trainer uses.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch.distributed as dist

from .errors import PlanError, PlanErrors
from .plan import Plan, load

__all__ = ["DryRun", "dry_run", "fake_process_group"]


@dataclass
class DryRun:
    """The outcome of a dry run: errors, or the applied plan's report."""

    world_size: int
    plan: Plan | None = None
    errors: list[PlanError] = field(default_factory=list)
    report: Any = None  # ApplyReport
    model: Any = None  # the parallelized meta model
    mesh: Any = None
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)  # further analyses, by name

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_json(self) -> dict[str, Any]:
        dims = self.report.dims if self.report is not None else None
        out = {
            "ok": self.ok,
            "errors": [e.to_json() for e in self.errors],
            "world_size": self.world_size,
            "mesh": dims.as_dict() if dims else None,
            "modules": [m.to_json() for m in self.report.modules] if self.report else [],
        }
        out.update({k: v for k, v in self.extra.items() if not k.startswith("_")})
        return out


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """A process group of ``world_size`` ranks in which collectives do nothing."""
    if dist.is_initialized():
        raise RuntimeError("a process group is already running; the dry run needs its own")
    dist.init_process_group("fake", rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def dry_run(plan_path: str, world_size: int, overrides: Sequence[str] = (),
            analyses: Sequence = ()) -> DryRun:
    """Load, check and apply a plan at ``world_size`` on meta tensors.

    ``analyses`` are callables ``(DryRun) -> None`` run while the fake process group is
    still up (the memory and communication estimates plug in here).
    """
    from .models import build_model

    start = time.perf_counter()
    result = DryRun(world_size)
    try:
        plan = result.plan = load(plan_path, overrides)
        model = build_model(plan.model, device="meta")
        res = plan.resolve(model, world_size)
        if res.errors:
            raise PlanErrors(res.errors)
        with fake_process_group(world_size):
            result.mesh = plan.parallel_dims(world_size).build_mesh("cpu")
            result.model = plan.apply(model, result.mesh)
            result.report = plan.last_report
            _ = result.report.modules  # rows while the mesh is alive
            for analysis in analyses:
                analysis(result)
    except PlanErrors as e:
        result.errors = e.errors
    result.seconds = time.perf_counter() - start
    return result
