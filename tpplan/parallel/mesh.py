"""The mesh as a value object: degrees checked against the world size, then the DeviceMesh,
and the data-parallel views of it every consumer needs (FSDP's sub-mesh, a rank's batch slice).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..plan.errors import PlanError, PlanErrors
from ..plan.specs import MeshSpec

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ParallelDims", "MESH_DIMS", "PP_MESH_DIMS", "EP_BORROWS", "dp_mesh", "dp_rank",
           "expert_meshes"]

# Outermost first: replicas talk least, tp most (it belongs inside a node's fast links).
MESH_DIMS = ("dp_replicate", "dp_shard", "tp")
# With pipeline stages: pp outermost (one activation per micro-batch crosses it, the least
# traffic of all), as in Megatron-LM's PTD-P and torchtitan.
PP_MESH_DIMS = ("pp", *MESH_DIMS)
# The dimensions expert parallelism borrows its ranks from, in mesh order (torchtitan's rule:
# every rank of these holds different tokens, so an all-to-all among them moves each token to
# its experts; context parallelism's ``cp`` joins them when the mesh has it). tp is not
# borrowed: its ranks hold the same tokens (docs/moe.md).
EP_BORROWS = ("dp_shard", "cp")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of a ``(pp, dp_replicate, dp_shard, tp)`` mesh whose product is the world size.

    ``ep`` adds no dimension of its own: it divides ``dp_shard`` (:data:`EP_BORROWS`), and
    the experts' weights are FSDP-sharded over the ``efsdp = dp_shard / ep`` ranks left."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int = 1
    ep: int = 1

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
        """:meth:`solve` for a plan's ``mesh`` section; :class:`PlanErrors` at its line (at
        ``ep``'s for an ``ep`` that does not divide the ranks it borrows)."""
        try:
            dims = cls.solve(mesh.tp, mesh.dp_shard, mesh.dp_replicate, world_size, mesh.pp)
        except ValueError as e:
            raise PlanErrors([PlanError(str(e), mesh.loc)]) from None
        if mesh.ep == 1:
            return dims
        try:
            return dims.with_ep(mesh.ep)
        except ValueError as e:
            raise PlanErrors([PlanError(str(e), mesh.locs.get("ep", mesh.loc))]) from None

    def with_ep(self, ep: int) -> "ParallelDims":
        """These degrees with expert parallelism ``ep`` borrowing ``dp_shard``'s ranks;
        ValueError if it does not divide them."""
        if ep < 1:
            raise ValueError(f"mesh ep must be at least 1, got {ep}")
        if self.dp_shard % ep:
            hint = (f"; tp={self.tp} ranks hold the same tokens, so ep does not borrow them"
                    if self.tp > 1 and (self.dp_shard * self.tp) % ep == 0 else "")
            raise ValueError(f"mesh ep={ep} must divide the data-parallel ranks it borrows: "
                             f"dp_shard={self.dp_shard} (world {self.world_size} = {self}){hint}")
        return replace(self, ep=ep)

    @property
    def efsdp(self) -> int:
        """The ranks each expert's weights are FSDP-sharded over: ``dp_shard / ep``."""
        return self.dp_shard // self.ep

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
        shown = dict(zip(self.names, self.shape))
        return {**shown, "ep": self.ep} if self.ep > 1 else shown

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


def expert_meshes(mesh: "DeviceMesh", ep: int) -> tuple["DeviceMesh", "DeviceMesh"]:
    """``(ep_mesh, efsdp_mesh)``: the ranks an experts module's all-to-all spans, and the
    ranks its weights are FSDP-sharded over (``(dp_replicate, efsdp)`` for HSDP).

    The borrowed dimensions (:data:`EP_BORROWS`) are flattened and unflattened into
    ``(efsdp, ep)``, ep innermost (consecutive ranks: the all-to-all is the heavier
    traffic). Both are views of the same root mesh, as FSDP2 needs for a DTensor parameter
    (Shard(0) on ep) sharded again over efsdp. Collective on every rank of ``mesh``; call
    it once per apply (each call makes process groups)."""
    from torch.distributed.device_mesh import DeviceMesh

    borrowed = tuple(n for n in EP_BORROWS if n in (mesh.mesh_dim_names or ()))
    base = mesh[borrowed]._flatten("_".join(borrowed)) if len(borrowed) > 1 else mesh[borrowed[0]]
    split = base._unflatten(0, (base.size() // ep, ep), ("efsdp", "ep"))
    efsdp = split["efsdp"]
    if mesh["dp_replicate"].size() > 1:
        efsdp = DeviceMesh._concatenate([mesh["dp_replicate"], efsdp])
    return split["ep"], efsdp
