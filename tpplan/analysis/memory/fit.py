"""Does the plan fit the device, per rank, and if not, which changes make it fit.

The need per rank is the step's peak (``memory_per_rank``) plus what the peak does not see,
stated as assumptions: the CUDA caching allocator's overhead over the bytes it hands out
(block rounding, fragmentation) and a fixed reserve for the CUDA context and NCCL's
buffers. Every change proposed is checked, not guessed: the plan is dry-run again with the
change (``--set`` lines a user can copy) and its own peak is compared with the device.
"""

from __future__ import annotations

from typing import Any, Sequence

from ...plan.devices import GiB, Device
from ..dryrun import DryRun, dry_run

__all__ = ["ALLOCATOR_OVERHEAD", "RUNTIME_RESERVE", "needed", "fit"]

ALLOCATOR_OVERHEAD = 0.10  # of the peak: the caching allocator's rounding and fragmentation
RUNTIME_RESERVE = 1 * GiB  # CUDA context, cuBLAS workspace, NCCL buffers


def needed(peak: int) -> int:
    """Device memory a rank needs for a step whose tracked peak is ``peak`` bytes."""
    return int(peak * (1 + ALLOCATOR_OVERHEAD)) + RUNTIME_RESERVE


def _candidates(result: DryRun) -> list[tuple[str, list[str]]]:
    """Changes that lower memory per rank, as (what, ``--set`` lines); each is checked."""
    spec, shape, dims = result.plan.spec, result.step, result.resolution.dims
    out = []
    lora = _lora_candidate(result)
    if lora:
        out.append(lora)
    ac = spec.activation_checkpointing
    if not (ac.enabled and ac.every == 1):
        out.append(("activation checkpointing of every block",
                    [f"activation_checkpointing={{mode: full{_ac_blocks(result)}}}"]))
    out += _ep_candidates(result)
    if spec.fsdp is not None and not spec.fsdp.param_dtype:
        out.append(("bf16 compute (FSDP mixed precision, fp32 gradient reduction)",
                    ["fsdp.mixed_precision={param_dtype: bfloat16, reduce_dtype: float32}"]))
    pipe = spec.pipeline
    # Under a pipeline the micro-batch follows from pipeline.microbatches: a micro-batch size
    # the plan also gives would contradict any change of the rank's share or their number.
    derived = ["train.micro_batch_size=null"] if pipe and spec.train.micro_batch_size else []
    wider: list[str] | None = [f"mesh.tp={2 * dims.tp}"]
    if spec.mesh.dp_shard != -1:  # a mesh that fixes dp_shard halves a dp degree
        if dims.dp_shard % 2 == 0:
            wider.append(f"mesh.dp_shard={dims.dp_shard // 2}")
        elif dims.dp_replicate % 2 == 0:
            wider.append(f"mesh.dp_replicate={dims.dp_replicate // 2}")
        else:
            wider = None
    if wider and result.world_size % (2 * dims.tp) == 0:
        out.append((f"tp {2 * dims.tp} (the same global batch over half the data ranks)",
                    [*wider, *derived]))
    if pipe is not None:
        if shape.micro_batch > 1:
            out.append((f"micro-batch {shape.micro_batch // 2} ({2 * pipe.microbatches} "
                        "pipeline micro-batches)",
                        [f"pipeline.microbatches={2 * pipe.microbatches}", *derived]))
        return out
    if shape.micro_batch > 1:
        out.append((f"micro-batch {shape.micro_batch // 2} (twice the accumulation)",
                    [f"train.micro_batch_size={shape.micro_batch // 2}"]))
    if shape.grad_accum > 1:
        out.append((f"micro-batch {shape.micro_batch * shape.grad_accum} (no accumulation: "
                    "no unsharded gradients kept)",
                    [f"train.micro_batch_size={shape.micro_batch * shape.grad_accum}"]))
    return out


def _ac_blocks(result: DryRun) -> str:
    """``, blocks: "..."`` naming the model's own repeated blocks (``model.layers.*`` in an
    HF model) where the plan's pattern is the default ``layers.*`` and matches none."""
    from ...models.introspect import find_blocks
    from ...plan.specs import DEFAULT_BLOCKS

    blocks = result.plan.spec.activation_checkpointing.blocks
    if blocks == DEFAULT_BLOCKS and result.model is not None:
        found = find_blocks(result.model)
        if found and found != DEFAULT_BLOCKS.removesuffix(".*"):
            return f', blocks: "{found}.*"'
    return "" if blocks == DEFAULT_BLOCKS else f', blocks: "{blocks}"'


def _ep_candidates(result: DryRun) -> list[tuple[str, list[str]]]:
    """Expert parallelism where the model has routed experts: ep doubled (then the largest
    that divides both ``dp_shard`` and every experts module's count), each rank keeping
    ``num_experts / ep`` of them (docs/moe.md). A plan without an ``expert_parallel`` rule
    gets one on its experts modules' pattern (replacing a rule already there, which one
    module cannot take beside it)."""
    from ...plan.patterns import generalize
    from ..comm.experts import experts_modules

    dims, res = result.resolution.dims, result.resolved
    if result.model is None or dims.pp > 1 or getattr(dims, "cp", 1) > 1:
        return []
    modules = experts_modules(result.model, res)
    if not modules:
        return []
    rule = []
    if not all(m.parallel for m in modules):
        for pattern in sorted({res.rule_of[m.path].pattern if m.path in res.rule_of
                               else generalize(m.path) for m in modules}):
            rule.append(f'tensor_parallel.{pattern}=expert_parallel')
    fits = [ep for ep in range(dims.ep + 1, dims.dp_shard + 1)
            if dims.dp_shard % ep == 0 and all(m.num_experts % ep == 0 for m in modules)]
    chosen = sorted({e for e in (2 * dims.ep, fits[-1] if fits else 0) if e in fits})
    experts = modules[0].num_experts
    return [(f"expert parallelism ep {ep} ({experts // ep} of {experts} experts per rank, "
             f"FSDP over the {dims.dp_shard // ep} ranks left)", [f"mesh.ep={ep}", *rule])
            for ep in chosen]


def _cp_change(result: DryRun, plan_path: str, base: list[str], capacity: int
               ) -> dict[str, Any] | None:
    """Context parallelism for a sequence that does not fit: ``mesh.cp`` doubled until it
    fits (each degree checked; the ranks come from dp_shard), else the degree that needed
    least. Doubling stops once a degree needs more than the one before: activations shrink
    with cp but FSDP shards the state over fewer ranks, so past that point every larger
    degree needs more still. None when the model's attention cannot be split (no seam) or
    no degree is possible. docs/long-context.md."""
    from ...parallel.context.sequence import position_kwarg

    spec, shape, dims = result.plan.spec, result.step, result.resolution.dims
    if result.model is None or position_kwarg(result.model) is None or spec.fsdp is None:
        return None
    chunks = spec.context_parallel.chunks
    tried = None
    cp = dims.cp * 2
    while dims.dp_shard % (cp // dims.cp) == 0 and shape.seq_len % chunks(cp) == 0:
        sets = [f"mesh.cp={cp}"]
        if spec.mesh.dp_shard != -1:  # the plan fixes dp_shard: cp takes its ranks
            sets.append(f"mesh.dp_shard={dims.dp_shard * dims.cp // cp}")
        what = (f"cp {cp} (context parallelism: each rank holds {shape.seq_len // cp:,} of the "
                f"{shape.seq_len:,} tokens, {spec.context_parallel.method} attention)")
        checked = _check(plan_path, result.world_size, base + sets, capacity)
        if checked["error"] is not None:
            return tried  # the plan cannot take this cp (the error says why)
        if tried is not None and checked["needed"] > tried["needed"]:
            return tried  # past the best degree: memory grows from here on
        tried = {"change": what, "set": sets, **checked}
        if checked["fits"]:
            break
        cp *= 2
    return tried


LORA_RANK = 16  # the rank a proposed LoRA assumes (alpha twice it, as is common)


def _lora_candidate(result: DryRun) -> tuple[str, list[str]] | None:
    """LoRA of rank 16 on every linear layer of the repeated blocks, when the plan trains
    full weights: the base frozen, so no gradients and no AdamW state for it."""
    import torch.nn as nn

    from ...plan.patterns import generalize

    if result.plan.spec.lora is not None or result.model is None:
        return None
    linears = sorted({generalize(p) for p, m in result.model.named_modules()
                      if isinstance(m, nn.Linear) and "*" in generalize(p)})
    if not linears:
        return None
    targets = ", ".join(f'"{t}"' for t in linears)
    return (f"LoRA rank {LORA_RANK} on the {len(linears)} linear layers of each block (the "
            "base frozen: no gradients, no AdamW state for it)",
            [f"lora={{targets: [{targets}], rank: {LORA_RANK}, alpha: {2 * LORA_RANK}}}"])


def _check(plan_path: str, world_size: int, overrides: Sequence[str], capacity: int) -> dict:
    from ..analyses import analyze_memory

    r = dry_run(plan_path, world_size, overrides, [("memory_per_rank", analyze_memory)],
                apply=False)
    if r.errors or r.analysis_errors:
        reason = r.errors[0].message if r.errors else r.analysis_errors[0].message
        return {"peak": None, "needed": None, "fits": False, "error": reason}
    peak = r.extra["memory_per_rank"]["peak"]
    return {"peak": peak, "needed": needed(peak), "fits": needed(peak) <= capacity,
            "error": None}


def fit(result: DryRun, device: Device, plan_path: str, overrides: Sequence[str],
        max_combined: int = 3) -> dict[str, Any]:
    """Fits or not, with the headroom; when not, each candidate change checked alone, then
    (if none fits alone) the best so far combined with each other, up to ``max_combined``."""
    peak = result.extra["memory_per_rank"]["peak"]
    need = needed(peak)
    out: dict[str, Any] = dict(
        device=device.to_json(), capacity=device.memory, peak=peak, needed=need,
        fits=need <= device.memory, headroom=device.memory - need,
        assumptions=dict(allocator_overhead=ALLOCATOR_OVERHEAD, runtime_reserve=RUNTIME_RESERVE),
        changes=[], fitting=None)
    if out["fits"]:
        return out
    candidates = _candidates(result)
    base = list(overrides)
    for what, sets in candidates:
        out["changes"].append({"change": what, "set": sets,
                               **_check(plan_path, result.world_size, base + sets, device.memory)})
    cp = _cp_change(result, plan_path, base, device.memory)
    if cp is not None:  # checked degree by degree: the smallest cp that fits, or the one needing least
        out["changes"].append(cp)
        candidates.append((cp["change"], cp["set"]))
    fitting = [c for c in out["changes"] if c["fits"]]
    if fitting:
        out["fitting"] = min(fitting, key=lambda c: c["needed"])
        return out
    # None alone: combine greedily, the largest saving first, each combination checked.
    tried = [c for c in out["changes"] if c["needed"] is not None]
    if not tried:
        return out
    best = min(tried, key=lambda c: c["needed"])
    combined = {"change": best["change"], "set": list(best["set"]), **best}
    for _ in range(max_combined - 1):
        steps = []
        for what, sets in candidates:
            if sets[0] in combined["set"] or any(s.split("=")[0] == sets[0].split("=")[0]
                                                 for s in combined["set"]):
                continue
            trial = {"change": f"{combined['change']} + {what}", "set": combined["set"] + sets}
            trial.update(_check(plan_path, result.world_size, base + trial["set"], device.memory))
            out["changes"].append(trial)
            if trial["needed"] is not None:
                steps.append(trial)
        if not steps:
            break
        combined = min(steps, key=lambda c: c["needed"])
        if combined["fits"]:
            out["fitting"] = combined
            break
    return out
