"""Estimated step time of a dry-run plan on a device: compute, communication, bubble.

Every term is in seconds per optimizer step on the busiest rank, so a user sees what
dominates (formulas, device figures and their sources: docs/search.md):

- ``compute``: the model's training FLOPs (:mod:`.flops`: ``3 ×`` forward, ``6N + 12·L·d·s``
  per token) on the rank, GEMM by GEMM, over ``bf16_flops × gemm_fraction × f(shape)``:
  ``gemm_fraction`` the rate a large GEMM measurably reaches on the device; ``f`` (:mod:`.gemm`)
  what the rank's own shapes lose to tile and wave quantization and bandwidth (and ×
  ``compute_efficiency``, standing for every other kernel, where ``non_gemm`` is not traced);
- ``non_gemm``: the traced step's memory-bound kernels (:mod:`.non_gemm`: bytes over HBM, a
  launch floor each), where the dry run traced them (``analyze_kernels``; a pipeline's busiest rank);
- ``recompute``: the forward of the blocks activation checkpointing recomputes in backward;
- ``tp``, ``fsdp`` (``dp_shard``), ``dp`` (``dp_replicate``), ``pp_p2p``: the dry run's
  collectives per mesh dimension (``comm_per_step``), each call ``α₀ + steps × α + wire
  bytes / β`` on the link that dimension's groups use (:mod:`.collectives`: NVLink inside a
  node, the GPU's NIC across nodes; α from NCCL's tuning model or the device). TP is on the
  critical path (``tp_overlap``); FSDP's and HSDP's collectives hide behind compute up to
  ``fsdp_overlap``, except the first all-gather of each micro-batch and the last
  reduce-scatter / all-reduce of the step (nothing to hide behind); rows of other sources
  (``ep``: all-to-all, hidden up to ``ep_overlap``; ``cp``) are their own terms;
- ``bubble``: the schedule's idle time, ``bubble_fraction × (compute + recompute + non_gemm
  + tp)`` (tpplan's bubble fraction: idle time over the rank's work, ``(p-1)/m`` for 1F1B).

MFU is the model's FLOPs (no recomputation) over ``step_time × peak × world``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ...plan.devices import Device
from .collectives import (MESH_ORDER, all_to_all_time, bandwidth, collective_time,
                          cp_all_gather_time, groups, latency, links, mesh_sizes,
                          ring_attention_time)
from .flops import ModelFlops, model_flops
from .gemm import gemm_efficiency, linear_splits, unit_work
from .non_gemm import gemm_constants, non_gemm_term

__all__ = ["CostConstants", "DEFAULT_CONSTANTS", "StepEstimate", "estimate_step", "calibrate",
           "links", "groups", "MESH_ORDER", "step_time_bound", "flops_of", "collective_time",
           "all_to_all_time", "ring_attention_time", "cp_all_gather_time", "gemm_efficiency"]

@dataclass(frozen=True)
class CostConstants:
    """Every assumption of the model, stated and configurable."""

    compute_efficiency: float = 0.625  # fraction of a large GEMM's rate the step's compute reaches
    intra_node_efficiency: float = 0.8  # fraction of NVLink bandwidth collectives reach
    inter_node_efficiency: float = 0.8  # fraction of the NIC's bandwidth
    fsdp_overlap: float = 0.9  # fraction of FSDP all-gather/reduce-scatter hidden by compute
    tp_overlap: float = 0.0  # fraction of TP collectives hidden (0: on the critical path)
    ep_overlap: float = 0.0  # fraction of EP all-to-alls hidden (0: dispatch/combine wait)
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


TERM_OF = {("tp", None): "tp", ("fsdp", "dp_shard"): "fsdp", ("fsdp", "dp_replicate"): "dp",
           ("pp", None): "pp_p2p", ("cp", None): "cp", ("fsdp", "dp_shard_cp"): "fsdp"}


def _comm(result, device: Device, gpus_per_node: int, c: CostConstants,
          collectives: list | None = None) -> tuple[dict, dict]:
    """Seconds per term (before overlap) and the first-unit exposure of the FSDP/DP terms,
    from the dry run's ``comm_per_step`` (or the rows ``collectives``); and the link of each
    dimension. Under a pipeline those rows are already the busiest pp rank's."""
    sizes = mesh_sizes(result.resolution.dims)
    group = groups(sizes, gpus_per_node)
    seconds: dict[str, float] = {}
    first: dict[str, float] = {}
    alpha: dict[str, float] = {}
    if collectives is None:
        collectives = result.extra["comm_per_step"]["collectives"]
    for row in collectives:
        if not row["wire_bytes"]:
            continue
        src, dim = row["source"], row["mesh_dim"]
        term = TERM_OF.get((src, dim)) or TERM_OF.get((src, None)) or src
        link, nodes = group.get(dim, ("intra", 1))
        lat = row["count"] * latency(row["kind"], sizes.get(dim, 1), link, device, nodes)
        t = lat + row["wire_bytes"] / bandwidth(device, link, c.intra_node_efficiency,
                                                c.inter_node_efficiency)
        seconds[term] = seconds.get(term, 0.0) + t
        alpha[term] = alpha.get(term, 0.0) + lat
        if term in ("fsdp", "dp"):  # nothing to hide behind: one all-gather per micro-batch
            once = result.step.grad_accum if row["kind"] == "all_gather" else 1
            first[term] = first.get(term, 0.0) + t * min(once, row["count"]) / row["count"]
    return seconds, dict(link={k: v[0] for k, v in group.items()}, first=first, latency=alpha)


def _rank_flops(flops: ModelFlops, result, work: dict[str, tuple[float, float, float]]
                ) -> tuple[float, float, float, float, int]:
    """The busiest pp rank's training and recomputed work per token (FLOPs over each GEMM's
    efficiency, ``work``: :func:`tpplan.analysis.cost.gemm.unit_work`), the FLOPs its kernels
    run (training and recomputed), the model's FLOPs of it, and how many pp ranks the
    model's units are divided over (1 without a pipeline)."""
    pipe = result.extra.get("pipeline")
    ranks = flops.rank_units(pipe.get("stages") if pipe else None)
    ac = result.plan.spec.activation_checkpointing
    ckpt = set(result.resolution.ac_blocks[::ac.every]) if ac.enabled else set()
    # A checkpointed block recomputes its forward; per-operator, only its unsaved matmuls (unit_work)
    fwd, fwd_run = (3, 4) if ac.mode == "op" else (0, 2)

    def cost(units) -> tuple[float, float]:
        return (sum(work[u][1] for u in units if u in work),
                sum(work[u][fwd] for u in units if u in work and u in ckpt))

    best = max(ranks, key=lambda u: sum(cost(u)))
    (train, recomputed), again = cost(best), [u for u in best if u in work and u in ckpt]
    run = sum(work[u][2] * 3 for u in best if u in work) + sum(work[u][fwd_run] for u in again)
    counted = flops.forward_of(ckpt & set(best)) if fwd == 0 else sum(work[u][4] for u in again)
    return train, recomputed, run, 3 * flops.forward_of(best) + counted, len(ranks)


def flops_of(result) -> ModelFlops:
    """The model's FLOPs per token at the dry run's sequence length, the checkpointing
    pattern's container counted as the blocks."""
    pattern = result.plan.spec.activation_checkpointing.blocks
    return model_flops(result.model, result.step.seq_len,
                       pattern.removesuffix(".*") if pattern.endswith(".*") else None)


def _compute(result, device: Device, c: CostConstants,
             flops: ModelFlops) -> tuple[dict, float, float]:
    """The compute and recompute terms of the busiest rank, the global tokens per step and
    the rank's FLOPs per step: the model's count, and what its kernels run."""
    if not device.bf16_flops:
        raise ValueError(f"device {device.name} has no bf16 peak: no compute estimate")
    step, dims = result.step, result.resolution.dims
    tokens = step.global_batch * step.seq_len
    speed = _rate(device, c)
    cp = getattr(dims, "cp", 1)  # context parallelism: each rank holds seq/cp of a sequence
    rows = step.micro_batch * step.seq_len // cp
    work = unit_work(flops, linear_splits(result.resolution.rule_of), dims.tp, rows,
                     step.micro_batch, step.seq_len // cp, device, speed)
    train, recomputed, run, counted, pp_ranks = _rank_flops(flops, result, work)
    per_rank_tokens = tokens / (result.world_size / pp_ranks)  # a stage's ranks split tokens
    return (dict(compute=train * per_rank_tokens / speed,
                 recompute=recomputed * per_rank_tokens / speed), tokens,
            (counted * per_rank_tokens, run * per_rank_tokens))


def _rate(device: Device, c: CostConstants) -> float:
    """FLOP/s of the step's compute at large, well-shaped GEMMs: the bf16 peak, times the
    fraction a large GEMM measurably reaches on the device (``gemm_fraction``), times
    ``compute_efficiency``."""
    return device.bf16_flops * (device.gemm_fraction or 1.0) * c.compute_efficiency


def step_time_bound(result, device: Device, constants: CostConstants | None = None,
                    flops: ModelFlops | None = None, fsdp: list[list] | None = None,
                    gpus_per_node: int = 8, traced: list[list] | None = None) -> float:
    """A lower bound of :func:`estimate_step`'s step time from arithmetic alone (no trace):
    compute and recompute, and the bubble on them; with ``fsdp`` (each pp rank's FSDP2 rows,
    :func:`tpplan.analysis.fsdp_rows`), the FSDP and DP terms too, the least of any rank's
    (the estimate takes the busiest rank's). Every other term is at least 0 (overlap hides
    at most what a term costs) and the bubble grows with the TP term it omits here.
    ``traced``: each pp rank's rows of a TP trace that the layout's own trace holds
    (:func:`tpplan.analysis.traced_rows` of the same layout without activation
    checkpointing, whose collectives a recomputing step issues all of, and more): their
    TP, ep and cp terms, and the bubble on TP, join each rank's. Needs ``pipeline`` (the
    schedule's facts) under a pipeline. GEMMs at their own rate where the device prices a
    non-GEMM term (at least the estimate's, with the term or without)."""
    c = gemm_constants(constants or DEFAULT_CONSTANTS, bool(device.memory_bandwidth))
    terms, _, _ = _compute(result, device, c, flops or flops_of(result))
    busy = terms["compute"] + terms["recompute"]
    bubble = (result.extra.get("pipeline") or {}).get("bubble_fraction", 0.0)
    bound = busy * (1 + bubble)
    if not fsdp:
        return bound
    ranks = [_comm(result, device, gpus_per_node, c, rows + (traced[i] if traced else []))
             for i, rows in enumerate(fsdp)]
    least = min(sum(_terms(raw, comm["first"], busy, bubble, c).values())
                for raw, comm in ranks)
    return max(bound, (busy + least) * (1 - 1e-12))  # below the estimate's sum, rounded


def _terms(raw: dict[str, float], first: dict[str, float], busy: float, bubble: float,
           c: CostConstants) -> dict[str, float]:
    """Every term but compute and recompute, from the seconds per term before overlap
    (``raw``), the first unit's exposure (``first``), the compute they hide behind
    (``busy``) and the schedule's bubble fraction."""
    terms = {"tp": raw.get("tp", 0.0) * (1 - c.tp_overlap)}
    terms.update(_exposed(raw, first, busy, c))
    terms["pp_p2p"] = raw.get("pp_p2p", 0.0)
    for k in raw.keys() - terms.keys():  # ep's all-to-alls, cp's exchanges (their own rows)
        terms[k] = raw[k] * (1 - c.ep_overlap if k == "ep" else 1.0)
    terms["bubble"] = bubble * (busy + terms["tp"])
    return terms


def _exposed(raw: dict[str, float], first: dict[str, float], busy: float,
             c: CostConstants) -> dict[str, float]:
    """The FSDP and DP terms: their seconds (``raw``) less what hides behind ``busy``, up to
    ``fsdp_overlap`` of all but the first unit's exposure (``first``)."""
    hideable = sum(raw.get(k, 0.0) - first.get(k, 0.0) for k in ("fsdp", "dp"))
    hidden = min(c.fsdp_overlap * hideable, busy)
    out = {}
    for k in ("fsdp", "dp"):
        rest = raw.get(k, 0.0) - first.get(k, 0.0)
        share = rest / hideable if hideable else 0.0
        out[k] = raw.get(k, 0.0) - hidden * share
    return out


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
    ng = non_gemm_term(result, device)  # the traced kernels that are not GEMMs, where traced
    g = gemm_constants(c, ng is not None)
    terms, tokens, (rank_flops, run_flops) = _compute(result, device, g, flops)
    gemms = terms["compute"] + terms["recompute"]
    if ng is not None:
        terms["non_gemm"] = ng["seconds"]
    raw, comm = _comm(result, device, gpus_per_node, c)
    busy = sum(terms.values())  # what the collectives hide behind and the bubble grows with
    pipe = result.extra.get("pipeline") or {}
    terms.update(_terms(raw, comm["first"], busy, pipe.get("bubble_fraction", 0.0), c))
    step_time = sum(terms.values())
    model = flops.train_per_token * tokens
    details = dict(
        device=device.to_json(), gpus_per_node=gpus_per_node, links=comm["link"],
        flops_per_token=flops.train_per_token, matmul_params=flops.matmul_params,
        attention_width=flops.attention_width, model_flops_per_step=model,
        rank_flops_per_step=rank_flops,
        gemm_efficiency=run_flops / (gemms * _rate(device, g)) if gemms else 1.0, non_gemm=ng,
        comm_seconds_before_overlap=raw, comm_latency_seconds=comm["latency"],
        first_unit_exposure=comm["first"], bubble_fraction=pipe.get("bubble_fraction", 0.0))
    return StepEstimate(
        step_time=step_time, tokens_per_step=tokens,
        tokens_per_s_per_device=tokens / step_time / world,
        mfu=model / (step_time * device.bf16_flops * world), terms=terms,
        dominant=max(terms, key=terms.get), constants=c, details=details)


def calibrate(metrics_paths, plan_path, overrides, device: Device, gpus_per_node: int = 8,
              constants: CostConstants | None = None, world_size: int | None = None):
    """Fit ``compute_efficiency`` (and a link's efficiency where the runs tell it apart) to
    measured step times (:mod:`.calibration`)."""
    from .calibration import fit_compute_efficiency

    return fit_compute_efficiency(metrics_paths, plan_path, overrides, device, gpus_per_node,
                                  constants or DEFAULT_CONSTANTS, world_size)
