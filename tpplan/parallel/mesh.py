"""The mesh as a value object: degrees checked against the world size, then the DeviceMesh,
and the data-parallel views of it every consumer needs (FSDP's sub-mesh, a rank's batch slice).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..plan.errors import PlanError, PlanErrors
from ..plan.specs import MeshSpec

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ParallelDims", "MESH_DIMS", "PP_MESH_DIMS", "dp_mesh", "dp_rank"]

# Outermost first: replicas talk least, tp most (it belongs inside a node's fast links).
MESH_DIMS = ("dp_replicate", "dp_shard", "tp")
# With pipeline stages: pp outermost (one activation per micro-batch crosses it, the least
# traffic of all), as in Megatron-LM's PTD-P and torchtitan.
PP_MESH_DIMS = ("pp", *MESH_DIMS)


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of a ``(pp, dp_replicate, dp_shard, tp)`` mesh whose product is the world size."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int = 1

    @classmethod
    def solve(cls, tp: int, dp_shard: int, dp_replicate: int, world_size: int,
              pp: int = 1) -> "ParallelDims":
        """Fill in ``dp_shard: -1`` and check the product; ValueError names every factor."""
        shown = f"dp_replicate={dp_replicate} × dp_shard={dp_shard} × tp={tp}"
        if pp != 1:
            shown = f"pp={pp} × {shown}"
        for name, v in (("tp", tp), ("dp_replicate", dp_replicate), ("pp", pp)):
            if v < 1:
                raise ValueError(f"mesh {name} must be at least 1, got {v}")
        if dp_shard == -1:
            fixed = tp * dp_replicate * pp
            if world_size % fixed:
                raise ValueError(
                    f"mesh {shown} does not fit world size {world_size}: "
                    f"{'pp × ' if pp != 1 else ''}dp_replicate × tp = {fixed} does not divide "
                    f"{world_size}"
                )
            dp_shard = world_size // fixed
        elif dp_shard < 1:
            raise ValueError(f"mesh dp_shard must be at least 1 or -1 (the rest), got {dp_shard}")
        dims = cls(dp_replicate, dp_shard, tp, pp)
        if dims.world_size != world_size:
            raise ValueError(
                f"mesh {shown} = {dims.world_size} ranks does not fit world size {world_size}"
            )
        return dims

    @classmethod
    def of(cls, mesh: MeshSpec, world_size: int) -> "ParallelDims":
        """:meth:`solve` for a plan's ``mesh`` section; :class:`PlanErrors` at its line."""
        try:
            return cls.solve(mesh.tp, mesh.dp_shard, mesh.dp_replicate, world_size, mesh.pp)
        except ValueError as e:
            raise PlanErrors([PlanError(str(e), mesh.loc)]) from None

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches one step sees."""
        return self.dp_replicate * self.dp_shard

    @property
    def shape(self) -> tuple[int, ...]:
        """``(dp_replicate, dp_shard, tp)``, with ``pp`` in front when there is a pipeline."""
        inner = (self.dp_replicate, self.dp_shard, self.tp)
        return (self.pp, *inner) if self.pp > 1 else inner

    @property
    def names(self) -> tuple[str, ...]:
        return PP_MESH_DIMS if self.pp > 1 else MESH_DIMS

    def as_dict(self) -> dict[str, int]:
        return dict(zip(self.names, self.shape))

    def build_mesh(self, device_type: str):
        """A DeviceMesh named ``(dp_replicate, dp_shard, tp)``, ``pp`` in front when the plan
        has pipeline stages; size-1 dimensions kept, so code can always slice ``mesh["tp"]``
        or ``mesh["dp_shard"]`` (within this rank's stage under a pipeline)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, self.shape, mesh_dim_names=self.names)

    def __str__(self) -> str:
        return " × ".join(f"{n}={v}" for n, v in self.as_dict().items())


def dp_mesh(mesh: "DeviceMesh") -> "DeviceMesh":
    """The mesh FSDP2 shards over: 2-D ``(dp_replicate, dp_shard)`` is HSDP."""
    if mesh["dp_replicate"].size() > 1:
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp_shard"]


def dp_rank(mesh: "DeviceMesh") -> int:
    """This rank's data-parallel index (which slice of the global batch it takes); tp peers
    share it, so they see the same batch."""
    return mesh["dp_replicate"].get_local_rank() * mesh["dp_shard"].size() + \
        mesh["dp_shard"].get_local_rank()
