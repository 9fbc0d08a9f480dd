"""The mesh as a value object: degrees checked against the world size, then the DeviceMesh,
and the data-parallel views of it every consumer needs (FSDP's sub-mesh, a rank's batch slice).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from .._torch.mesh import concatenate, flatten, unflatten
from ..plan.errors import PlanError, PlanErrors
from ..plan.specs import MeshSpec

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ParallelDims", "MESH_DIMS", "PP_MESH_DIMS", "EP_BORROWS", "EP_BORROWS_TP", "dp_mesh", "dp_rank",
           "cp_mesh", "expert_meshes"]

# Outermost first: replicas talk least, tp most (it belongs inside a node's fast links).
MESH_DIMS = ("dp_replicate", "dp_shard", "tp")
# With pipeline stages: pp outermost (one activation per micro-batch crosses it, the least
# traffic of all), as in Megatron-LM's PTD-P and torchtitan.
PP_MESH_DIMS = ("pp", *MESH_DIMS)
# Context parallelism (only when cp > 1): between dp_shard and tp, as in torchtitan; its
# ranks take the same batch, and FSDP shards parameters over dp_shard × cp flattened.
CP_DIM, DP_SHARD_CP = "cp", "dp_shard_cp"
# The dimensions expert parallelism borrows its ranks from, in mesh order (torchtitan's rule:
# every rank of these holds different tokens, so an all-to-all among them moves each token to
# its experts; context parallelism's ``cp`` joins them when the mesh has it). tp joins them
# only when the MoE blocks run on each tp rank's sequence shard (the ``sequence_local`` style):
# otherwise its ranks hold the same tokens (docs/moe.md, "The mesh rule").
EP_BORROWS = ("dp_shard", "cp")
EP_BORROWS_TP = (*EP_BORROWS, "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of a ``(pp, dp_replicate, dp_shard, cp, tp)`` mesh whose product is the world size.

    ``ep`` adds no dimension of its own: it divides ``dp_shard × cp`` (:data:`EP_BORROWS`),
    or ``dp_shard × cp × tp`` when ``ep_borrows_tp`` (the MoE blocks run on each tp rank's
    sequence shard), and the experts' weights are FSDP-sharded over the ``efsdp`` ranks left."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int = 1
    cp: int = 1
    ep: int = 1
    ep_borrows_tp: bool = False

    @classmethod
    def solve(cls, tp: int, dp_shard: int, dp_replicate: int, world_size: int,
              pp: int = 1, cp: int = 1) -> "ParallelDims":
        """Fill in ``dp_shard: -1`` and check the product; ValueError names every factor."""
        shown = f"dp_replicate={dp_replicate} × dp_shard={dp_shard} × " \
            f"{f'cp={cp} × ' if cp != 1 else ''}tp={tp}"
        if pp != 1:
            shown = f"pp={pp} × {shown}"
        for name, v in (("tp", tp), ("dp_replicate", dp_replicate), ("pp", pp), ("cp", cp)):
            if v < 1:
                raise ValueError(f"mesh {name} must be at least 1, got {v}")
        if dp_shard == -1:
            fixed = tp * dp_replicate * pp * cp
            if world_size % fixed:
                raise ValueError(
                    f"mesh {shown} does not fit world size {world_size}: "
                    f"{'pp × ' if pp != 1 else ''}dp_replicate × {'cp × ' if cp != 1 else ''}"
                    f"tp = {fixed} does not divide "
                    f"{world_size}"
                )
            dp_shard = world_size // fixed
        elif dp_shard < 1:
            raise ValueError(f"mesh dp_shard must be at least 1 or -1 (the rest), got {dp_shard}")
        dims = cls(dp_replicate, dp_shard, tp, pp, cp)
        if dims.world_size != world_size:
            raise ValueError(
                f"mesh {shown} = {dims.world_size} ranks does not fit world size {world_size}"
            )
        return dims

    @classmethod
    def of(cls, mesh: MeshSpec, world_size: int, borrow_tp: bool = False) -> "ParallelDims":
        """:meth:`solve` for a plan's ``mesh`` section; :class:`PlanErrors` at its line (at
        ``ep``'s for an ``ep`` that does not divide the ranks it borrows). ``borrow_tp``: the
        plan's MoE blocks run on the sequence shard (:func:`tpplan.plan.styles.ep_borrows_tp`)."""
        try:
            dims = cls.solve(mesh.tp, mesh.dp_shard, mesh.dp_replicate, world_size, mesh.pp,
                             getattr(mesh, "cp", 1))
        except ValueError as e:
            raise PlanErrors([PlanError(str(e), mesh.loc)]) from None
        if mesh.ep == 1:
            return dims
        try:
            return dims.with_ep(mesh.ep, borrow_tp)
        except ValueError as e:
            raise PlanErrors([PlanError(str(e), mesh.locs.get("ep", mesh.loc))]) from None

    def with_ep(self, ep: int, borrow_tp: bool = False) -> "ParallelDims":
        """These degrees with expert parallelism ``ep`` borrowing ``dp_shard``'s ranks (and
        ``cp``'s: they hold different tokens too; and ``tp``'s with ``borrow_tp``, when the
        MoE blocks run on each tp rank's sequence shard); ValueError if it does not divide
        them."""
        if ep < 1:
            raise ValueError(f"mesh ep must be at least 1, got {ep}")
        borrow_tp = borrow_tp and self.tp > 1
        ranks = self.fsdp_shard * (self.tp if borrow_tp else 1)
        if ranks % ep:
            hint = (f"; tp={self.tp} ranks hold the same tokens at the experts, so ep does not "
                    "borrow them unless the MoE blocks run on the sequence shard (style "
                    "sequence_local on the block, as import-hf --sequence-parallel --ep writes "
                    "it; docs/moe.md)"
                    if self.tp > 1 and not borrow_tp and (ranks * self.tp) % ep == 0 else "")
            parts = [f"dp_shard={self.dp_shard}"] + [f"cp={self.cp}"] * (self.cp > 1) + \
                [f"tp={self.tp}"] * borrow_tp
            borrowed = " × ".join(parts) + (f" = {ranks}" if len(parts) > 1 else "")
            raise ValueError(f"mesh ep={ep} must divide the {'' if borrow_tp else 'data-parallel '}"
                             f"ranks it borrows: {borrowed} (world {self.world_size} = {self})"
                             f"{hint}")
        return replace(self, ep=ep, ep_borrows_tp=borrow_tp)

    @property
    def efsdp(self) -> int:
        """The ranks each expert's weights are FSDP-sharded over: ``dp_shard × cp / ep``
        (``dp_shard × cp × tp / ep`` when ep borrows tp)."""
        return self.fsdp_shard * self.ep_tp // self.ep

    @property
    def ep_tp(self) -> int:
        """The tp ranks among those ep borrows: ``tp`` when the experts see each tp rank's
        sequence shard, else 1 (every tp rank dispatches the same tokens in its own group)."""
        return self.tp if self.ep_borrows_tp else 1

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches one step sees."""
        return self.dp_replicate * self.dp_shard

    @property
    def shape(self) -> tuple[int, ...]:
        """``(dp_replicate, dp_shard, tp)``, with ``pp`` in front when there is a pipeline
        and ``cp`` before ``tp`` under context parallelism."""
        inner = (self.dp_replicate, self.dp_shard, *((self.cp,) if self.cp > 1 else ()), self.tp)
        return (self.pp, *inner) if self.pp > 1 else inner

    @property
    def names(self) -> tuple[str, ...]:
        names = PP_MESH_DIMS if self.pp > 1 else MESH_DIMS
        if self.cp > 1:
            names = (*names[:-1], CP_DIM, names[-1])
        return names

    @property
    def fsdp_shard(self) -> int:
        """The ranks one parameter is sharded over: dp_shard × cp."""
        return self.dp_shard * self.cp

    def as_dict(self) -> dict[str, int]:
        shown = dict(zip(self.names, self.shape))
        return {**shown, "ep": self.ep} if self.ep > 1 else shown

    def build_mesh(self, device_type: str):
        """A DeviceMesh named ``(dp_replicate, dp_shard, tp)``, ``pp`` in front when the plan
        has pipeline stages; size-1 dimensions kept, so code can always slice ``mesh["tp"]``
        or ``mesh["dp_shard"]`` (within this rank's stage under a pipeline)."""
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=self.names)
        if self.cp > 1:  # FSDP's shard dimension: mesh["dp_shard_cp"] from here on
            flatten(mesh["dp_shard", CP_DIM], DP_SHARD_CP)
        return mesh

    def __str__(self) -> str:
        return " × ".join(f"{n}={v}" for n, v in self.as_dict().items())


def dp_mesh(mesh: "DeviceMesh") -> "DeviceMesh":
    """The mesh FSDP2 shards over: 2-D ``(dp_replicate, dp_shard)`` is HSDP; under context
    parallelism ``dp_shard × cp`` flattened takes dp_shard's place (cp ranks hold the same
    parameters and see parts of one sequence, so their gradients are reduced too)."""
    import warnings

    shard = DP_SHARD_CP if CP_DIM in (mesh.mesh_dim_names or ()) else "dp_shard"
    with warnings.catch_warnings():  # torch 2.13 warns on slicing a flattened dimension from
        warnings.simplefilter("ignore", UserWarning)  # the root: still the documented way
        if mesh["dp_replicate"].size() > 1:
            return mesh["dp_replicate", shard]
        return mesh[shard]


def dp_rank(mesh: "DeviceMesh") -> int:
    """This rank's data-parallel index (which slice of the global batch it takes); tp peers
    share it, so they see the same batch."""
    return mesh["dp_replicate"].get_local_rank() * mesh["dp_shard"].size() + \
        mesh["dp_shard"].get_local_rank()


def cp_mesh(mesh: "DeviceMesh") -> "DeviceMesh | None":
    """The context-parallel sub-mesh, None when the plan has no ``cp`` dimension."""
    return mesh[CP_DIM] if CP_DIM in (mesh.mesh_dim_names or ()) else None


def group_dim(group_name: str) -> str | None:
    """The mesh dimension the process group ``group_name`` was made for, read from the
    description DeviceMesh gives every group it makes (``mesh_<dimension>``: an experts'
    ``ep`` group is told from ``tp``'s or ``dp_shard``'s of the same ranks); None for a
    group without one, or none of this process."""
    from .._torch.collectives import resolve_process_group

    try:
        desc = resolve_process_group(group_name).group_desc
    except (ValueError, RuntimeError, KeyError):
        return None
    return desc.removeprefix("mesh_") if desc and desc.startswith("mesh_") else None


def expert_meshes(mesh: "DeviceMesh", ep: int,
                  borrow_tp: bool = False) -> tuple["DeviceMesh", "DeviceMesh"]:
    """``(ep_mesh, efsdp_mesh)``: the ranks an experts module's all-to-all spans, and the
    ranks its weights are FSDP-sharded over (``(dp_replicate, efsdp)`` for HSDP).

    The borrowed dimensions (:data:`EP_BORROWS`, :data:`EP_BORROWS_TP` with ``borrow_tp``)
    are flattened and unflattened into ``(efsdp, ep)``, ep innermost (consecutive ranks: the
    all-to-all is the heavier traffic, and with tp borrowed an ep group is first the tp
    ranks, on a node's fast links). Both are views of the same root mesh, as FSDP2 needs for
    a DTensor parameter (Shard(0) on ep) sharded again over efsdp. Collective on every rank
    of ``mesh``; call it once per apply (each call makes process groups)."""
    names = EP_BORROWS_TP if borrow_tp and mesh["tp"].size() > 1 else EP_BORROWS
    borrowed = tuple(n for n in names if n in (mesh.mesh_dim_names or ()))
    if len(borrowed) > 1 and borrowed != EP_BORROWS:  # (dp_shard, [cp,] tp): flattened here
        base = flatten(mesh[borrowed], "_".join(borrowed))
    else:  # under cp, build_mesh's dp_shard × cp flattening (FSDP's dimension): the same ranks
        base = mesh[DP_SHARD_CP] if borrowed == EP_BORROWS else mesh[borrowed[0]]
    split = unflatten(base, 0, (base.size() // ep, ep), ("efsdp", "ep"))
    efsdp = split["efsdp"]
    if mesh["dp_replicate"].size() > 1:
        efsdp = concatenate([mesh["dp_replicate"], efsdp])
    return split["ep"], efsdp
