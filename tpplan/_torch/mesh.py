"""DeviceMesh's private operations: flattening, unflattening, joining, and its groups.

Checked on torch 2.11 through 2.14.1, where ``DeviceMesh._flatten``, ``_unflatten`` and the
staticmethod ``_concatenate`` are the only way to make a mesh dimension from others
(torchtitan uses the same) and ``torch.distributed.device_mesh.new_group`` is the name
DeviceMesh calls to make each dimension's groups.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["concatenate", "flatten", "own_groups_only", "unflatten"]


def flatten(mesh: "DeviceMesh", name: str) -> "DeviceMesh":
    """``mesh``'s dimensions as one, named ``name`` on its root mesh:
    ``DeviceMesh._flatten(mesh_dim_name)`` (2.11-2.14.1)."""
    return mesh._flatten(name)


def unflatten(mesh: "DeviceMesh", dim: int, sizes: tuple[int, ...],
              names: tuple[str, ...]) -> "DeviceMesh":
    """``mesh`` with dimension ``dim`` split into ``sizes`` named ``names``:
    ``DeviceMesh._unflatten(dim, mesh_sizes, mesh_dim_names)`` (2.11-2.14.1)."""
    return mesh._unflatten(dim, sizes, names)


def concatenate(meshes: list["DeviceMesh"]) -> "DeviceMesh":
    """The meshes (views of one root) joined into one: the staticmethod
    ``DeviceMesh._concatenate`` (2.11-2.14.1), as FSDP2 joins its mesh and TP's."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh._concatenate(meshes)


@contextlib.contextmanager
def own_groups_only(rank: int) -> Iterator[None]:
    """DeviceMesh's process groups made only where ``rank`` is in them: every other call
    of ``torch.distributed.device_mesh.new_group`` (the name DeviceMesh calls, 2.11-2.14.1)
    hands back ``GroupMember.NON_GROUP_MEMBER``, as ``new_group`` does to a non-member."""
    from torch.distributed import device_mesh
    from torch.distributed.distributed_c10d import GroupMember

    original = device_mesh.new_group

    def new_group(*args, **kwargs):
        ranks = kwargs.get("ranks", args[0] if args else None)
        if ranks is not None and rank not in ranks:
            return GroupMember.NON_GROUP_MEMBER
        return original(*args, **kwargs)

    device_mesh.new_group = new_group
    try:
        yield
    finally:
        device_mesh.new_group = original
