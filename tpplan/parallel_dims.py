"""The mesh as a value object: degrees checked against the world size, then the DeviceMesh."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ParallelDims", "MESH_DIMS"]

# Outermost first: replicas talk least, tp most (it belongs inside a node's fast links).
MESH_DIMS = ("dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of a ``(dp_replicate, dp_shard, tp)`` mesh whose product is the world size."""

    dp_replicate: int
    dp_shard: int
    tp: int

    @classmethod
    def solve(cls, tp: int, dp_shard: int, dp_replicate: int, world_size: int) -> "ParallelDims":
        """Fill in ``dp_shard: -1`` and check the product; ValueError names every factor."""
        shown = f"dp_replicate={dp_replicate} × dp_shard={dp_shard} × tp={tp}"
        for name, v in (("tp", tp), ("dp_replicate", dp_replicate)):
            if v < 1:
                raise ValueError(f"mesh {name} must be at least 1, got {v}")
        if dp_shard == -1:
            fixed = tp * dp_replicate
            if world_size % fixed:
                raise ValueError(
                    f"mesh {shown} does not fit world size {world_size}: "
                    f"dp_replicate × tp = {fixed} does not divide {world_size}"
                )
            dp_shard = world_size // fixed
        elif dp_shard < 1:
            raise ValueError(f"mesh dp_shard must be at least 1 or -1 (the rest), got {dp_shard}")
        dims = cls(dp_replicate, dp_shard, tp)
        if dims.world_size != world_size:
            raise ValueError(
                f"mesh {shown} = {dims.world_size} ranks does not fit world size {world_size}"
            )
        return dims

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches one step sees."""
        return self.dp_replicate * self.dp_shard

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.dp_replicate, self.dp_shard, self.tp)

    def as_dict(self) -> dict[str, int]:
        return dict(zip(MESH_DIMS, self.shape))

    def build_mesh(self, device_type: str):
        """A 3-D DeviceMesh named ``(dp_replicate, dp_shard, tp)``; size-1 dimensions kept,
        so code can always slice ``mesh["tp"]`` or ``mesh["dp_shard"]``."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_DIMS)

    def __str__(self) -> str:
        return " × ".join(f"{n}={v}" for n, v in self.as_dict().items())
