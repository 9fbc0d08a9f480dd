"""HF checkpoints whose tensors are named and cut otherwise than the model's: per-expert MoE.

transformers 5 holds a mixture of experts' routed experts fused, ``[num_experts, ...]``
(``experts.gate_up_proj`` ``[E, 2I, H]``, ``experts.down_proj`` ``[E, H, I]``), while the
Hub's MoE checkpoints -- and transformers' own ``save_pretrained`` -- hold one tensor per
expert and projection (``experts.N.gate_proj.weight``; Mixtral's
``block_sparse_moe.experts.N.w1/w2/w3.weight``). transformers maps one to the other with its
weight conversions (``transformers.conversion_mapping``): renamings (Mixtral's
``.block_sparse_moe.`` -> ``.mlp.``), then per fused tensor a ``MergeModulelist(dim=0)``
(the experts stacked, in index order) and a ``Concatenate(dim=1)`` (the source patterns in
their order: gate rows, then up rows). :func:`conversion` reads that mapping *from the
installed transformers, for the model at hand* and the checkpoint's names (headers only), and
says which slice of which model tensor each checkpoint tensor is. :class:`ConvertingLoadPlanner`
then reads into each rank's shards only the per-expert slices they hold (under ep, the experts
the rank owns; under expert FSDP, its share of them; under expert TP, its rows of each);
:meth:`Fused.piece` cuts a fused tensor back for ``export --format hf``.

Other conversions (a ``Transpose``: Qwen3-VL-MoE's experts) are named as unsupported; a fused
checkpoint (names equal to the model's) needs none.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
from torch.distributed.tensor import DTensor

from .._torch.dtensor import compute_local_shape_and_global_offset
from .hf_weights import TensorInfo, compress_names
from .packed_io import PackedLoadPlanner, local_chunks

__all__ = ["Conversion", "ConvertingLoadPlanner", "Fused", "conversion", "saved_names"]


@dataclass(frozen=True)
class Fused:
    """A model tensor stacked from per-expert checkpoint tensors: ``parts[j][e]`` is the
    checkpoint name of part ``j`` (gate, up) of expert ``e``, each of shape ``part_shapes[j]``;
    the experts stacked on ``stack_dim``, the parts concatenated on ``cat_dim`` (a dimension of
    the stacked tensor; None for one part)."""

    parts: tuple[tuple[str, ...], ...]
    part_shapes: tuple[tuple[int, ...], ...]
    stack_dim: int = 0
    cat_dim: int | None = None

    @property
    def experts(self) -> int:
        return len(self.parts[0])

    def _src_dim(self) -> int | None:
        """The concatenated dimension in a part's own (unstacked) frame."""
        if self.cat_dim is None:
            return None
        return self.cat_dim - (self.cat_dim > self.stack_dim)

    def _spans(self) -> list[tuple[int, int]]:
        d, start, out = self._src_dim(), 0, []
        for shape in self.part_shapes:
            n = shape[d] if d is not None else 0
            out.append((start, start + n))
            start += n
        return out

    def shape(self) -> tuple[int, ...]:
        base = list(self.part_shapes[0])
        d = self._src_dim()
        if d is not None:
            base[d] = self._spans()[-1][1]
        base.insert(self.stack_dim, self.experts)
        return tuple(base)

    def reads(self, offsets, sizes) -> list[tuple[int, str, list[int], list[int], list[int]]]:
        """The per-expert slices that fill the block ``offsets``/``sizes`` of the fused
        tensor: (expert's index in the block, checkpoint name, offsets in that tensor,
        lengths, offsets in the block's expert slice)."""
        sd, d = self.stack_dim, self._src_dim()
        off = [o for i, o in enumerate(offsets) if i != sd]
        size = [s for i, s in enumerate(sizes) if i != sd]
        out = []
        for i in range(sizes[sd]):
            e = offsets[sd] + i
            for j, (start, end) in enumerate(self._spans()):
                if d is None:
                    out.append((i, self.parts[j][e], off, size, [0] * len(off)))
                    continue
                lo, hi = max(off[d], start), min(off[d] + size[d], end)
                if lo >= hi:
                    continue
                src, n, dest = list(off), list(size), [0] * len(off)
                src[d], n[d], dest[d] = lo - start, hi - lo, lo - off[d]
                out.append((i, self.parts[j][e], src, n, dest))
        return out

    def piece(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """The checkpoint tensor ``name`` cut from the full fused ``tensor`` (export)."""
        for j, names in enumerate(self.parts):
            if name in names:
                t = tensor.select(self.stack_dim, names.index(name))
                d = self._src_dim()
                if d is not None:
                    start, end = self._spans()[j]
                    t = t.narrow(d, start, end - start)
                return t.contiguous()
        raise KeyError(name)


@dataclass
class Conversion:
    """How a checkpoint's tensors map onto a model's: ``renamed`` (model name -> checkpoint
    name, where they differ), ``fused`` (model name -> its per-expert sources), and what
    keeps the mapping from holding (``problems``)."""

    renamed: dict[str, str] = field(default_factory=dict)
    fused: dict[str, Fused] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    failed: dict[str, set[str]] = field(default_factory=dict)  # model name -> its sources

    def checkpoint_name(self, model_name: str) -> str:
        return self.renamed.get(model_name, model_name)

    def as_model(self, found: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
        """``found`` (checkpoint names) under the model's names, per-expert tensors as the
        fused tensor they make (shape and dtype): what ``mismatches`` holds the model to."""
        used = {n for f in self.fused.values() for names in f.parts for n in names}
        used |= {n for names in self.failed.values() for n in names}  # said in problems
        back = {v: k for k, v in self.renamed.items()}
        out = {back.get(n, n): info for n, info in found.items() if n not in used}
        for name, f in self.fused.items():
            first = found[f.parts[0][0]]
            out[name] = TensorInfo(f.shape(), first.dtype, first.file)
        return out


def _transforms(model: nn.Module, legacy: bool = True):
    """transformers' weight conversions for ``model`` (renamings, converters), or none:
    ``from_pretrained``'s (``legacy``: old names too, such as ``LayerNorm.gamma``) or
    ``save_pretrained``'s."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:
        return [], []
    if not isinstance(model, PreTrainedModel):
        return [], []
    transforms = get_model_conversion_mapping(model, add_legacy=legacy)
    return ([t for t in transforms if isinstance(t, WeightRenaming)],
            [t for t in transforms if isinstance(t, WeightConverter)])


def _ops(converter) -> tuple[int, int | None] | str:
    """(stack dim, concat dim) of a converter made of MergeModulelist [+ Concatenate], else
    the names of its operations (unsupported)."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(getattr(converter, "operations", []))
    if ops and isinstance(ops[0], MergeModulelist):
        if len(ops) == 1:
            return ops[0].dim, None
        if len(ops) == 2 and isinstance(ops[1], Concatenate):
            return ops[0].dim, ops[1].dim
    return " + ".join(type(o).__name__ for o in ops) or "no operation"


def _expert_index(pattern: str, name: str) -> int | None:
    body = re.escape(pattern).replace(r"\*", r"(\d+)")
    m = re.search(body, name)
    return int(m.group(1)) if m and m.groups() else None


def conversion(model: nn.Module, found: dict[str, TensorInfo]) -> Conversion:
    """How the checkpoint tensors ``found`` (name -> header info) fill ``model``, by the
    installed transformers' own conversion mapping for it (see the module docstring)."""
    out = Conversion()
    renamings, converters = _transforms(model)
    if not renamings and not converters:
        return out
    from transformers.core_model_loading import rename_source_key

    own = dict.fromkeys(model.state_dict())
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    groups: dict[str, dict] = {}
    for name in sorted(found):
        target, pattern = rename_source_key(name, renamings, converters,
                                            getattr(model, "base_model_prefix", None), own)
        if pattern is None:
            if target != name:
                out.renamed[target] = name
            continue
        conv = by_pattern[pattern]
        how = _ops(conv)
        e = _expert_index(pattern, name)
        if isinstance(how, str) or e is None:
            out.problems.append(f"{name} maps to {target} by a conversion tpplan cannot read "
                                f"slice by slice ({how if isinstance(how, str) else pattern})")
            continue
        g = groups.setdefault(target, {"how": how, "sources": conv.source_patterns, "parts": {}})
        g["parts"].setdefault(conv.source_patterns.index(pattern), {})[e] = name
    for target, g in groups.items():
        parts, shapes, bad = [], [], []
        for j, source in enumerate(g["sources"]):
            experts = g["parts"].get(j, {})
            names = [experts.get(e) for e in range(max(experts, default=-1) + 1)]
            if not experts or None in names:
                bad.append(f"'{source.strip('.')}' has experts {sorted(experts) or 'none'}, "
                           f"not every one of 0..{len(names) - 1}")
                continue
            kinds = {(found[n].shape, found[n].dtype) for n in names}
            if len(kinds) > 1:
                bad.append(f"its experts' tensors differ in shape or dtype: "
                           f"{', '.join(compress_names(names))}")
                continue
            parts.append(tuple(names))
            shapes.append(found[names[0]].shape)
        if not bad and len({len(p) for p in parts}) > 1:
            bad.append(f"its parts hold {', '.join(str(len(p)) for p in parts)} experts")
        if bad:
            out.failed[target] = {n for experts in g["parts"].values() for n in experts.values()}
            out.problems.append(f"{target} cannot be made from the checkpoint's per-expert "
                                f"tensors: {'; '.join(bad)}")
            continue
        out.fused[target] = Fused(tuple(parts), tuple(shapes), *g["how"])
    return out


def saved_names(model: nn.Module) -> Conversion:
    """The per-expert layout transformers' ``save_pretrained`` writes for ``model`` (every
    tensor's name and its slice of the model's), from its shapes alone (meta tensors): what
    ``export --format hf`` writes for a model loaded that way."""
    from transformers.core_model_loading import revert_weight_conversion

    renamings, converters = _transforms(model, legacy=False)
    if not converters:
        return Conversion()
    state = {k: torch.empty(v.shape, device="meta") for k, v in model.state_dict().items()}
    saved = revert_weight_conversion(model, state)
    return conversion(model, {k: TensorInfo(tuple(v.shape), "F32", "") for k, v in saved.items()})


def _local_blocks(t: torch.Tensor, packing):
    """This rank's blocks of ``t`` in the model's order: (offsets, sizes, local view)."""
    if isinstance(t, DTensor):
        if packing is not None:
            local = t.to_local()
            for chunk, pos, n in local_chunks(t, packing):
                yield list(chunk.offsets), list(chunk.sizes), local.narrow(packing.dim, pos, n)
            return
        sizes, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh,
                                                               t.placements)
        yield list(offsets), list(sizes), t.to_local()
        return
    yield [0] * t.dim(), list(t.shape), t


class ConvertingLoadPlanner(PackedLoadPlanner):
    """:class:`PackedLoadPlanner` that also fills ``fused`` model tensors from per-expert
    checkpoint tensors: for each block of the model tensor this rank holds, a read of just
    the slice of each expert's tensor that lands in it -- no rank reads an expert it does
    not hold, nor assembles a full fused tensor."""

    def __init__(self, packed, fused: dict[str, Fused], **kwargs) -> None:
        super().__init__(packed, **kwargs)
        self.fused = fused
        self._expert_views: dict[tuple, torch.Tensor] = {}

    def create_local_plan(self):
        mine = {k: self.state_dict.pop(k) for k in list(self.state_dict) if k in self.fused}
        try:
            plan = super().create_local_plan()
        finally:
            self.state_dict.update(mine)
        items = list(plan.items)
        for fqn, t in mine.items():
            f = self.fused[fqn]
            for offsets, sizes, view in _local_blocks(t, self.packed.get(fqn)):
                if 0 in sizes:
                    continue
                for i, src, src_off, n, dest in f.reads(offsets, sizes):
                    key = (offsets[f.stack_dim] + i, *offsets)
                    self._expert_views[(fqn, key)] = view.select(f.stack_dim, i)
                    items.append(ReadItem(
                        type=LoadItemType.TENSOR, dest_index=MetadataIndex(fqn, key),
                        dest_offsets=torch.Size(dest),
                        storage_index=MetadataIndex(src, [0] * len(src_off)),
                        storage_offsets=torch.Size(src_off), lengths=torch.Size(n)))
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        view = self._expert_views.get((index.fqn, tuple(index.offset or ())))
        return view if view is not None else super().lookup_tensor(index)
