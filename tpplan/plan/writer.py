"""Writing plans as commented YAML (``suggest`` and ``import-hf``)."""

from __future__ import annotations

import os
from typing import Any

import yaml

__all__ = ["flow", "relocate", "render_plan"]


def flow(value: Any) -> str:
    """One-line YAML for a value: ``{style: rowwise, output_layouts: shard(1)}``."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {flow(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(flow(v) for v in value) + "]"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str) and any(ch in value for ch in "*{}[],:#&!|>'\"%@`") \
            and not value.startswith("shard("):
        return '"' + value.replace('"', '\\"') + '"'
    return str(value)


def render_plan(header: list[str], model: dict[str, Any], rules: list[tuple[str, Any, str]],
                *, tp: int = 2, loss_parallel: bool = False, divide_by_tp: list[str] = (),
                units: list[Any] = (), notes: list[str] = (), ep: int = 1) -> str:
    lines = [f"# {h}" if h else "#" for h in header]
    ep_key = f"ep: {ep}, " if ep > 1 else ""
    lines += [f"mesh: {{tp: {tp}, {ep_key}dp_shard: -1}}", f"model: {flow(model)}", "",
              "tensor_parallel:"]
    for pattern, style, comment in rules:
        if comment:
            lines.append(f"  # {comment}")
        lines.append(f"  {flow(pattern)}: {flow(style)}")
    if not rules:
        lines[-1] = "tensor_parallel: {}"
    lines.append("")
    lines.append(f"loss_parallel: {flow(loss_parallel)}")
    if divide_by_tp:
        lines.append("# head counts the model stores and uses in forward: per rank after sharding")
        lines.append(f"divide_by_tp: {flow(list(divide_by_tp))}")
    lines.append(f"fsdp: {{units: {flow(list(units))}}}")
    if notes:
        lines.append("")
        lines.append("# Not decided automatically:")
        lines += [f"#   - {n}" for n in notes]
    text = "\n".join(lines) + "\n"
    yaml.safe_load(text)  # what we write must read back
    return text


def relocate(model: dict, from_dir: str, output: str | None) -> dict:
    """Keep a relative ``hf_config`` path pointing at the same file from the new plan's folder."""
    path = model.get("hf_config")
    if not path or os.path.isabs(path):
        return model
    target = os.path.join(from_dir, path)
    to_dir = os.path.dirname(os.path.abspath(output)) if output else os.getcwd()
    return {**model, "hf_config": os.path.relpath(os.path.abspath(target), to_dir)}
