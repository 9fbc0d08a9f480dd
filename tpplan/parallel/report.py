"""What ``plan.apply`` did: which rule hit which modules, and the shape of every shard."""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..plan.patterns import generalize
from .resolve import Resolution

__all__ = ["ApplyReport", "ModuleRow", "ParamRow", "describe_params"]


@dataclass
class ParamRow:
    name: str
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    placements: str
    dtype: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "global_shape": list(self.global_shape),
                "local_shape": list(self.local_shape), "placements": self.placements,
                "dtype": self.dtype}


@dataclass
class ModuleRow:
    path: str
    type: str
    rule: str | None  # the pattern, with its line
    style: str | None
    params: list[ParamRow] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "type": self.type, "rule": self.rule, "style": self.style,
                "params": [p.to_json() for p in self.params]}


def _placements(param) -> str:
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return "local"
    names = param.device_mesh.mesh_dim_names or tuple(str(i) for i in range(param.device_mesh.ndim))
    return " ".join(f"{n}:{p}" for n, p in zip(names, param.placements))


def describe_params(module: nn.Module) -> list[ParamRow]:
    """Global and (this rank's) local shape of each parameter directly on ``module``."""
    from torch.distributed.tensor import DTensor

    rows = []
    for name, p in module.named_parameters(recurse=False):
        local = p.to_local() if isinstance(p, DTensor) else p
        rows.append(ParamRow(name, tuple(p.shape), tuple(local.shape), _placements(p),
                             str(p.dtype).removeprefix("torch.")))
    return rows


class ApplyReport:
    """Made by :meth:`Plan.apply`: rules with the modules they hit, and a row per module
    that has a rule or parameters. ``print(report)`` prints the collapsed table.
    ``router_shards``: the tp mesh when the model's routers see sequence shards
    (``sequence_local`` blocks), else None: the model's load-balancing loss is then taken
    over the whole micro-batch (:func:`tpplan.models.moe_loss.gather_router_logits`)."""

    def __init__(self, res: Resolution, seconds: float = 0.0, model: nn.Module | None = None,
                 rows: list[ModuleRow] | None = None, router_shards: DeviceMesh | None = None):
        self.resolution, self.seconds = res, seconds
        self.dims = res.dims
        self.rules = [(rule, paths) for rule, paths in res.rules]
        self.router_shards = router_shards
        # Rows are made on first use: apply() stays as fast as the bare torch calls.
        # ``rows``: made already (the dry run's, from the model's first blocks).
        self._model = weakref.ref(model) if model is not None else None
        self._module_rows: list[ModuleRow] | None = rows

    @property
    def modules(self) -> list[ModuleRow]:
        if self._module_rows is None:
            model = self._model() if self._model is not None else None
            self._module_rows = [] if model is None else self._rows(model)
        return self._module_rows

    def _rows(self, model: nn.Module) -> list[ModuleRow]:
        rule_of = self.resolution.rule_of
        rows = []
        for path, module in model.named_modules():
            rule = rule_of.get(path)
            params = describe_params(module)
            if rule is None and not params:
                continue
            rows.append(ModuleRow(
                path or "<root>", type(module).__name__,
                f"{os.path.basename(rule.loc.file)}:{rule.loc.line}" if rule else None,
                rule.style.describe() if rule else None, params))
        return rows

    def collapsed(self) -> list[tuple[str, int, ModuleRow]]:
        """Rows of repeated blocks merged: ``layers.*.attention.wq ×80``."""
        groups: dict[tuple, list] = {}
        for row in self.modules:
            key = (generalize(row.path), row.type, row.rule, row.style,
                   tuple((p.name, p.global_shape, p.local_shape, p.placements) for p in row.params))
            groups.setdefault(key, [key[0], 0, row])[1] += 1
        return [tuple(v) for v in groups.values()]

    def table(self, title: str | None = None):
        from rich.table import Table
        from rich.text import Text

        t = Table(title=title, show_lines=False, header_style="bold")
        for col in ("module", "×", "rule", "style", "parameter", "global shape", "local shape",
                    "placements"):
            t.add_column(col, overflow="fold", no_wrap=col in ("module", "×", "rule"))
        for path, count, row in self.collapsed():
            params = row.params or [None]
            for i, p in enumerate(params):
                first = i == 0
                cells = (path if first else "", str(count) if first else "",
                         (row.rule or "-") if first else "", (row.style or "-") if first else "",
                         p.name if p else "", _shape(p.global_shape) if p else "",
                         _shape(p.local_shape) if p else "", p.placements if p else "")
                t.add_row(*(Text(c) for c in cells))  # Text: '[shard(1), null]' is not markup
        return t

    def __str__(self) -> str:
        lines = [f"applied in {self.seconds * 1000:.0f} ms on {self.dims}"]
        for rule, paths in self.rules:
            lines.append(f"  {rule.pattern} -> {rule.style.describe()}: {len(paths)} modules")
        return "\n".join(lines)


def _shape(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"
