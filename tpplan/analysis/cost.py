"""Estimated step time of a dry-run plan on a device: compute, communication, bubble.

Every term is in seconds per optimizer step on the busiest rank, so a user sees what
dominates (formulas, device figures and their sources: docs/search.md):

- ``compute``: the model's training FLOPs (:mod:`.flops`: ``3 ×`` forward, ``6N + 12·L·d·s``
  per token) on the rank, over ``device.bf16_flops × compute_efficiency``;
- ``recompute``: the forward of the blocks activation checkpointing recomputes in backward;
- ``tp``, ``fsdp`` (``dp_shard``), ``dp`` (``dp_replicate``), ``pp_p2p``: the dry run's wire
  bytes per mesh dimension (``comm_per_step``: ring-algorithm bytes one rank sends) over
  the link that dimension's groups use -- NVLink (half the quoted both-ways figure, one
  direction) when a group fits in a node, else the GPU's NIC -- times the link's
  efficiency. TP is on the critical path (``tp_overlap``); FSDP's and HSDP's collectives
  hide behind compute up to ``fsdp_overlap``, except the first all-gather of each
  micro-batch and the last reduce-scatter / all-reduce of the step (nothing to hide behind);
- ``bubble``: the schedule's idle time, ``bubble_fraction × (compute + recompute + tp)``
  (tpplan's bubble fraction is idle time over the rank's work, ``(p-1)/m`` for 1F1B).

MFU is the model's FLOPs (no recomputation) over ``step_time × peak × world``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ..plan.devices import Device
from .flops import ModelFlops, model_flops

__all__ = ["CostConstants", "DEFAULT_CONSTANTS", "StepEstimate", "estimate_step", "calibrate",
           "links", "MESH_ORDER", "step_time_bound", "flops_of"]

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "tp")  # outermost first; tp innermost


@dataclass(frozen=True)
class CostConstants:
    """Every assumption of the model, stated and configurable."""

    compute_efficiency: float = 0.5  # fraction of the dense bf16 peak the matmuls reach
    intra_node_efficiency: float = 0.8  # fraction of NVLink bandwidth collectives reach
    inter_node_efficiency: float = 0.8  # fraction of the NIC's bandwidth
    fsdp_overlap: float = 0.9  # fraction of FSDP all-gather/reduce-scatter hidden by compute
    tp_overlap: float = 0.0  # fraction of TP collectives hidden (0: on the critical path)
    source: str = "defaults"

    def to_json(self) -> dict:
        return asdict(self)

    def with_values(self, text: str) -> "CostConstants":
        """``compute=0.45,fsdp_overlap=0.95`` (names with or without ``_efficiency``);
        ValueError naming what is accepted."""
        names = [f for f in asdict(self) if f != "source"]
        short = {n.removesuffix("_efficiency"): n for n in names}
        values: dict[str, float] = {}
        for item in filter(None, (t.strip() for t in text.split(","))):
            key, _, value = item.partition("=")
            key = short.get(key.strip(), key.strip())
            if key not in names:
                raise ValueError(f"unknown constant '{key}' in '{item}'; expected one of: "
                                 f"{', '.join(short)}")
            try:
                v = float(value)
            except ValueError:
                raise ValueError(f"'{item}': {key} must be a number") from None
            if not (0 < v <= 1 or (key.endswith("overlap") and v == 0)):
                raise ValueError(f"'{item}': {key} must be in (0, 1]"
                                 f"{' or 0' if key.endswith('overlap') else ''}")
            values[key] = v
        given = ", ".join(f"{k}={v:g}" for k, v in values.items())
        return replace(self, **values, source=f"{self.source}, {given}" if given else self.source)


DEFAULT_CONSTANTS = CostConstants()


@dataclass
class StepEstimate:
    step_time: float  # seconds per optimizer step
    tokens_per_step: int  # global
    tokens_per_s_per_device: float
    mfu: float  # model FLOPs (no recompute) / (step_time * peak)
    terms: dict[str, float]  # seconds per term
    dominant: str  # the largest term's name
    constants: CostConstants
    details: dict[str, Any] = field(default_factory=dict)  # flops, links, bandwidths used

    def to_json(self) -> dict:
        return dict(step_time=self.step_time, tokens_per_step=self.tokens_per_step,
                    tokens_per_s_per_device=self.tokens_per_s_per_device, mfu=self.mfu,
                    terms=self.terms, dominant=self.dominant,
                    constants=self.constants.to_json(), details=self.details)


def links(sizes: dict[str, int], gpus_per_node: int) -> dict[str, str]:
    """``intra`` or ``inter`` for each mesh dimension of more than one rank: ranks are laid
    out ``pp × dp_replicate × dp_shard × tp`` (tp innermost, consecutive ranks on one node),
    so a dimension's group spans ``stride × size`` consecutive ranks, ``stride`` the product
    of the inner dimensions; it stays in a node when that span is at most ``gpus_per_node``.
    ``dp`` is dp_replicate and dp_shard flattened."""
    out, stride = {}, 1
    for dim in reversed(MESH_ORDER):
        n = sizes.get(dim, 1)
        if n > 1:
            out[dim] = "intra" if stride * n <= gpus_per_node else "inter"
        if dim == "dp_shard":
            dp = n * sizes.get("dp_replicate", 1)
            if dp > 1:
                out["dp"] = "intra" if stride * dp <= gpus_per_node else "inter"
        stride *= n
    return out


def _bandwidth(device: Device, link: str, c: CostConstants) -> float:
    """Bytes/s one rank sends at over ``link``: NVLink's quoted figure counts both
    directions, a ring sends in one; the NIC's is one direction already."""
    if link == "intra":
        if not device.intra_node_bandwidth:
            raise ValueError(f"device {device.name} has no intra-node bandwidth")
        return device.intra_node_bandwidth / 2 * c.intra_node_efficiency
    if not device.inter_node_bandwidth:
        raise ValueError(f"device {device.name} has no inter-node bandwidth: a mesh dimension "
                         "spans nodes (raise --gpus-per-node or give the device one)")
    return device.inter_node_bandwidth * c.inter_node_efficiency


TERM_OF = {("tp", None): "tp", ("fsdp", "dp_shard"): "fsdp", ("fsdp", "dp_replicate"): "dp",
           ("pp", None): "pp_p2p"}


def _comm(result, device: Device, gpus_per_node: int, c: CostConstants) -> tuple[dict, dict]:
    """Seconds per term (before overlap) and the first-unit exposure of the FSDP/DP terms,
    from the dry run's ``comm_per_step``; and the link of each dimension. Under a pipeline
    those rows are already the busiest pp rank's, for its own stages."""
    dims = result.resolution.dims
    if dims.ep > 1:
        raise ValueError("expert parallelism (mesh.ep) is not in the step-time model yet: its "
                         "all-to-all and efsdp traffic are in the communication table (docs/moe.md)")
    sizes = dict(pp=dims.pp, dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard, tp=dims.tp)
    link = links(sizes, gpus_per_node)
    seconds: dict[str, float] = {}
    first: dict[str, float] = {}
    comm = result.extra["comm_per_step"]
    for row in comm["collectives"]:
        if not row["wire_bytes"]:
            continue
        term = TERM_OF.get((row["source"], row["mesh_dim"])) or TERM_OF[(row["source"], None)]
        t = row["wire_bytes"] / _bandwidth(device, link.get(row["mesh_dim"], "intra"), c)
        seconds[term] = seconds.get(term, 0.0) + t
        if term in ("fsdp", "dp"):  # nothing to hide behind: one all-gather per micro-batch
            once = result.step.grad_accum if row["kind"] == "all_gather" else 1
            first[term] = first.get(term, 0.0) + t * min(once, row["count"]) / row["count"]
    return seconds, dict(link=link, first=first)


def _rank_flops(flops: ModelFlops, result) -> tuple[float, float, int]:
    """Training and recomputed FLOPs per token of the busiest pp rank's units, and how many
    pp ranks the model's units are divided over (1 without a pipeline)."""
    pipe = result.extra.get("pipeline")
    ranks = flops.rank_units(pipe.get("stages") if pipe else None)
    ac = result.plan.spec.activation_checkpointing
    ckpt = set(result.resolution.ac_blocks[::ac.every]) if ac.enabled else set()
    best = max(ranks, key=lambda u: 3 * flops.forward_of(u) + flops.forward_of(ckpt & set(u)))
    return 3 * flops.forward_of(best), flops.forward_of(ckpt & set(best)), len(ranks)


def flops_of(result) -> ModelFlops:
    """The model's FLOPs per token at the dry run's sequence length, the checkpointing
    pattern's container counted as the blocks."""
    pattern = result.plan.spec.activation_checkpointing.blocks
    return model_flops(result.model, result.step.seq_len,
                       pattern.removesuffix(".*") if pattern.endswith(".*") else None)


def _compute(result, device: Device, c: CostConstants,
             flops: ModelFlops) -> tuple[dict, float, float]:
    """The compute and recompute terms of the busiest rank, the global tokens per step and
    the rank's FLOPs per step."""
    if not device.bf16_flops:
        raise ValueError(f"device {device.name} has no bf16 peak: no compute estimate")
    tokens = result.step.global_batch * result.step.seq_len
    train, recomputed, pp_ranks = _rank_flops(flops, result)
    per_rank_tokens = tokens / (result.world_size / pp_ranks)  # a stage's ranks split tokens
    speed = device.bf16_flops * c.compute_efficiency
    return (dict(compute=train * per_rank_tokens / speed,
                 recompute=recomputed * per_rank_tokens / speed), tokens,
            (train + recomputed) * per_rank_tokens)


def step_time_bound(result, device: Device, constants: CostConstants | None = None,
                    flops: ModelFlops | None = None) -> float:
    """A lower bound of :func:`estimate_step`'s step time from arithmetic alone (no trace):
    compute and recompute, and the bubble on them. Every other term is at least 0 (overlap
    hides at most what a term costs) and the bubble grows with the TP term it omits here.
    Needs ``pipeline`` (the schedule's facts) under a pipeline."""
    c = constants or DEFAULT_CONSTANTS
    terms, _, _ = _compute(result, device, c, flops or flops_of(result))
    bubble = (result.extra.get("pipeline") or {}).get("bubble_fraction", 0.0)
    return (terms["compute"] + terms["recompute"]) * (1 + bubble)


def estimate_step(result, device: Device, gpus_per_node: int = 8,
                  constants: CostConstants | None = None,
                  flops: ModelFlops | None = None) -> StepEstimate:
    """The step time of ``result`` (a dry run with the memory and communication analyses)
    on ``device``, ``gpus_per_node`` to a node, under ``constants``; ``flops``: the model's
    (:func:`flops_of`), when the caller has it."""
    c = constants or DEFAULT_CONSTANTS
    if "comm_per_step" not in result.extra or "error" in result.extra["comm_per_step"]:
        raise ValueError("the dry run has no communication analysis (comm_per_step)")
    if result.resolution.dims.pp > 1 and "bubble_fraction" not in result.extra.get("pipeline", {}):
        raise ValueError("the dry run has no pipeline schedule (its memory analysis failed)")
    world = result.world_size
    flops = flops or flops_of(result)
    terms, tokens, rank_flops = _compute(result, device, c, flops)
    raw, comm = _comm(result, device, gpus_per_node, c)
    terms["tp"] = raw.get("tp", 0.0) * (1 - c.tp_overlap)
    busy = terms["compute"] + terms["recompute"]
    hideable = sum(raw.get(k, 0.0) - comm["first"].get(k, 0.0) for k in ("fsdp", "dp"))
    hidden = min(c.fsdp_overlap * hideable, busy)
    for k in ("fsdp", "dp"):
        rest = raw.get(k, 0.0) - comm["first"].get(k, 0.0)
        share = rest / hideable if hideable else 0.0
        terms[k] = raw.get(k, 0.0) - hidden * share
    terms["pp_p2p"] = raw.get("pp_p2p", 0.0)
    pipe = result.extra.get("pipeline") or {}
    terms["bubble"] = pipe.get("bubble_fraction", 0.0) * (busy + terms["tp"])
    step_time = sum(terms.values())
    model = flops.train_per_token * tokens
    details = dict(
        device=device.to_json(), gpus_per_node=gpus_per_node, links=comm["link"],
        flops_per_token=flops.train_per_token, matmul_params=flops.matmul_params,
        attention_width=flops.attention_width, model_flops_per_step=model,
        rank_flops_per_step=rank_flops,
        comm_seconds_before_overlap=raw, first_unit_exposure=comm["first"],
        bubble_fraction=pipe.get("bubble_fraction", 0.0))
    return StepEstimate(
        step_time=step_time, tokens_per_step=tokens,
        tokens_per_s_per_device=tokens / step_time / world,
        mfu=model / (step_time * device.bf16_flops * world), terms=terms,
        dominant=max(terms, key=terms.get), constants=c, details=details)


def calibrate(metrics_paths, plan_path, overrides, device: Device, gpus_per_node: int = 8,
              constants: CostConstants | None = None, world_size: int | None = None):
    """Fit ``compute_efficiency`` to measured step times (:mod:`.calibration`)."""
    from .calibration import fit_compute_efficiency

    return fit_compute_efficiency(metrics_paths, plan_path, overrides, device, gpus_per_node,
                                  constants or DEFAULT_CONSTANTS, world_size)
