"""FSDP2's internals: its module path, its parameter sharding, its per-parameter state.

Checked on torch 2.11 through 2.14.1, where FSDP2 lives in
``torch.distributed.fsdp._fully_shard``; torch 2.4 to 2.5 had it in
``torch.distributed._composable.fsdp`` (tried as a fallback).
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Callable, Iterator

import torch.nn as nn

__all__ = ["fsdp_internals", "fsdp_init_on_demand", "sharded_params"]

_PATHS = ("torch.distributed.fsdp._fully_shard", "torch.distributed._composable.fsdp")


def fsdp_internals(name: str) -> Any:
    """FSDP2's private submodule ``name`` (``_fsdp_param``, ``_fsdp_param_group``), wherever
    this torch keeps it; one clear error where neither known path has it."""
    import torch

    for path in _PATHS:
        try:
            return importlib.import_module(f"{path}.{name}")
        except ImportError:
            continue
    raise ImportError(f"torch {torch.__version__}: FSDP2's {name} is in none of {', '.join(_PATHS)} "
                      f"(tpplan supports torch 2.11 through 2.14.1)")


def sharded_params(module: nn.Module) -> list:
    """The ``FSDPParam``s of ``module``'s own FSDP2 parameter group (none where it is not a
    ``fully_shard`` unit), each as ``(storage of its sharded data, shard degree, length of
    the dimension it shards)``. Relies on ``module._get_fsdp_state()._fsdp_param_group`` and an
    ``FSDPParam``'s ``_sharded_param_data``, ``_orig_size``, ``mesh_info`` and
    ``fsdp_placement`` (2.11-2.14.1)."""
    state = getattr(module, "_get_fsdp_state", None)
    group = state and state()._fsdp_param_group
    return [(fp._sharded_param_data.untyped_storage(), fp.mesh_info.shard_mesh_size,
             fp._orig_size[fp.fsdp_placement.dim]) for fp in (group.fsdp_params if group else ())]


@contextlib.contextmanager
def fsdp_init_on_demand(chunks: Callable) -> Iterator[None]:
    """FSDP2's parameter sharding with ``chunks`` in place of its ``_chunk_with_empty``, each
    mesh pair joined once and each data-parallel mesh's shard dimension sliced once: the same
    tensors and meshes, made only as often as they differ; and its parameter groups without
    profiler marks.

    Patches ``_fsdp_param._chunk_with_empty``, ``DeviceMesh._concatenate`` (a staticmethod),
    ``FSDPParam._init_shard_mesh`` (2.13 on; absent in 2.11, where it is left alone) and
    ``_fsdp_param_group.record_function``; everything is restored on exit."""
    from torch.distributed.device_mesh import DeviceMesh

    _fsdp_param, _fsdp_param_group = fsdp_internals("_fsdp_param"), fsdp_internals("_fsdp_param_group")
    original_chunks, original_concatenate = _fsdp_param._chunk_with_empty, DeviceMesh._concatenate
    original_shard_mesh = getattr(_fsdp_param.FSDPParam, "_init_shard_mesh", None)
    original_marks = _fsdp_param_group.record_function
    concatenated: dict[tuple[int, ...], tuple[list, DeviceMesh]] = {}
    sliced: dict[int, tuple[DeviceMesh, DeviceMesh]] = {}

    def concatenate(meshes: list) -> DeviceMesh:
        # FSDP2 joins its data-parallel mesh and a parameter's TP mesh once per parameter;
        # the joined mesh depends only on the two meshes, so each pair is joined once.
        key = tuple(map(id, meshes))
        if key not in concatenated:  # the meshes are kept with it, so their ids stay theirs
            concatenated[key] = (list(meshes), original_concatenate(meshes))
        return concatenated[key][1]

    def shard_mesh(param) -> DeviceMesh:  # noqa: ANN001 - an FSDPParam
        # Under HSDP every parameter of a unit slices its 2-D mesh's shard dimension anew
        # (a DeviceMesh each, equal to the others): a third of a first forward's setup (8B).
        mesh = param.mesh_info.mesh
        if id(mesh) not in sliced:  # the mesh is kept with its slice, so its id stays its own
            sliced[id(mesh)] = (mesh, original_shard_mesh(param))
        return sliced[id(mesh)][1]

    _fsdp_param._chunk_with_empty = chunks
    DeviceMesh._concatenate = staticmethod(concatenate)
    if original_shard_mesh is not None:
        _fsdp_param.FSDPParam._init_shard_mesh = shard_mesh
    # A parameter group's profiler marks (eight a unit a micro-batch): ops that make nothing,
    # each a dispatch through every mode up; no dry run has a profiler to read them.
    _fsdp_param_group.record_function = lambda _name: contextlib.nullcontext()
    try:
        yield
    finally:
        _fsdp_param._chunk_with_empty = original_chunks
        DeviceMesh._concatenate = staticmethod(original_concatenate)
        if original_shard_mesh is not None:
            _fsdp_param.FSDPParam._init_shard_mesh = original_shard_mesh
        _fsdp_param_group.record_function = original_marks
