"""Where a generated plan's blocks hold a sequence shard (``import-hf --sequence-parallel``).

Under sequence parallelism inside blocks (each block's rule hands it a sequence shard), a
rowwise projection writes its output back as a sequence shard (``output_layouts: shard(1)``)
only where the dataflow is sequence-sharded: inside a sequence-parallel block and not inside
a module that runs on the whole sequence (an MoE block with its shared expert, a
hyper-connection mixer: their prepare rule gathers the sequence and shards the output back
itself). Elsewhere the projection's output stays whole.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["sequence_regions", "writes_sequence_shard"]


def _desired(style: dict[str, Any]) -> list[str]:
    out = []
    for key in ("desired_input_layouts", "desired_input_kwarg_layouts"):
        value = style.get(key)
        values = value.values() if isinstance(value, dict) else \
            value if isinstance(value, list) else [value]
        out += [str(v) for v in values if v is not None]
    return out


def sequence_regions(rules: list, hits: Callable[[str], list[str]]) -> tuple[set[str], set[str]]:
    """(modules handed a sequence shard, modules run on the whole sequence) by the
    ``prepare_input_output`` rules among ``rules``."""
    sharded, whole = set(), set()
    for pattern, style, _ in rules:
        if not isinstance(style, dict) or style.get("style") != "prepare_input_output":
            continue
        desired = _desired(style)
        if "shard(1)" in desired:
            sharded.update(hits(pattern))
        elif "replicate" in desired:
            whole.update(hits(pattern))
    return sharded, whole


def writes_sequence_shard(modules: list[str], regions: tuple[set[str], set[str]]) -> bool:
    """Whether every one of ``modules`` sits in a sequence-sharded block, outside any module
    run on the whole sequence."""
    sharded, whole = regions

    def under(m: str, roots: set[str]) -> bool:
        return any(m.startswith(r + ".") for r in roots)

    return bool(modules) and all(under(m, sharded) and not under(m, whole) for m in modules)
