"""The analyses ``tpplan validate`` runs (:data:`ANALYSES`), each adding its figures to
``DryRun.extra``: memory per rank (from :mod:`.memory`) and communication per step (from
:mod:`.comm`), with the helpers other analyses share (the model's blocks, the compute dtypes,
the FSDP and traced TP rows).
"""

from __future__ import annotations

import dataclasses

from collections import Counter
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch

from ..models import build_model
from ..plan.specs import torch_dtype
from .comm.step import Accumulation, diagnose, fsdp_collectives, megatron_minimum, rows, wire_bytes
from .dryrun import Analysis, DryRun
from .memory.per_rank import memory_per_rank
from .memory.step import ModelBuilder
from .comm.tp_trace import TPTrace, identical_blocks, trace_tp

__all__ = ["ANALYSES", "analyze_kernels", "analyze_memory", "analyze_comm", "fsdp_rows", "traced_rows",
           "compute_dtypes", "model_blocks"]


def analyze_memory(result: DryRun, trace: Callable = memory_per_rank,
                   over: Callable[[int], bool] | None = None) -> None:
    """``memory_per_rank``: bytes per rank by part and the step's peak, from the trainer's
    step run on fake tensors (docs/dry-run.md). ``trace``: :func:`memory_per_rank` or a
    function with its signature that answers the same (``search``'s cache); ``over``: a
    pipeline's stages traced only until a pp rank's peak is too large for it
    (:func:`~tpplan.analysis.memory.stages.pipeline_memory`), the rank with the highest
    first-forward bound first where ``memory_floor`` left its figures on ``result``."""
    spec = result.plan.spec
    if spec.pipeline is not None:
        from .memory.stages import pipeline_memory

        floor = result.extra.get("memory_floor") if over else None
        first = floor and (max(floor["pp_ranks"], key=floor["pp_ranks"].get), floor["boundary"])
        mem, result.extra["pipeline"] = pipeline_memory(
            spec, result.mesh, lambda: build_model(spec.model, "meta"), result.step,
            result.resolution.dims, trace, over, first)
        mem["batch"]["compute_dtype"] = str(compute_dtypes(result)[0]).removeprefix("torch.")
        result.extra["memory_per_rank"] = mem
        return
    blocks, n_blocks = model_blocks(result)
    mem = trace(spec, result.mesh, _builder(result), result.step, n_blocks, blocks)
    mem["batch"]["compute_dtype"] = str(compute_dtypes(result)[0]).removeprefix("torch.")
    _experts_memory(result, mem)
    result.extra["memory_per_rank"] = mem


def _builder(result: DryRun) -> ModelBuilder:
    """What makes the traces' models: cut copies of ``result.model`` where it is as built
    (not parallelized: ``search``'s, and ``validate``'s where its module table came from a
    cut copy), else new ones."""
    spec = result.plan.spec
    return ModelBuilder(lambda: build_model(spec.model, "meta"),
                        None if result.parallelized else result.model)


def model_blocks(result: DryRun) -> tuple[str | None, int]:
    """The path of the model's identical repeated blocks and how many (None, 0 if none):
    what the memory trace may cut to three shallow depths."""
    found = identical_blocks(result.model, result.resolution.rule_of)
    blocks = found[2] if found else None
    return blocks, len(result.model.get_submodule(blocks)) if blocks else 0


def _experts_memory(result: DryRun, mem: dict[str, Any]) -> None:
    """The routed experts' share of the parameters, gradients and AdamW state per rank
    (``mem["experts"]``), where the model has experts (:mod:`tpplan.analysis.comm.experts`)."""
    from .comm.experts import expert_memory, experts_modules

    modules = experts_modules(result.model, result.resolved)
    if modules:
        mem["experts"] = expert_memory(modules, result.resolved.dims)


def compute_dtypes(result: DryRun) -> tuple[torch.dtype, torch.dtype]:
    """What forward/backward compute in and gradients are reduced in: FSDP's mixed
    precision where the plan sets it, else the model's own floating-point dtype."""
    import torch

    fsdp = result.plan.spec.fsdp
    own = next((p.dtype for p in result.model.parameters() if p.is_floating_point()),
               torch.float32)
    param = torch_dtype(fsdp.param_dtype) if fsdp and fsdp.param_dtype else own
    reduce = torch_dtype(fsdp.reduce_dtype) if fsdp and fsdp.reduce_dtype else param
    return param, reduce


def analyze_comm(result: DryRun, tp_trace: Callable = trace_tp, stage_cache: dict | None = None,
                 minimum: bool = True) -> None:
    """``comm_per_step`` (TP traced on meta, FSDP from its units) and ``comm_minimum``; with
    pipeline stages, per pp rank, for its own stages (:mod:`tpplan.analysis.comm.stages`).
    ``search`` passes its caches: ``tp_trace``, a function with :func:`trace_tp`'s
    signature, and ``stage_cache`` for a pipeline's stages (traced with their ends by
    ``comm.stages``); and ``minimum=False`` (it ranks by the step's traffic, not by the
    Megatron minimum, which walks the model)."""
    spec, res, shape = result.plan.spec, result.resolved, result.step
    dims = res.dims
    param, reduce = compute_dtypes(result)
    step = accumulation(result, param, reduce)
    parts = None
    if spec.pipeline is not None:
        from .comm.stages import pipeline_comm

        comm, trace, parts = pipeline_comm(result, param, reduce, step, stage_cache)
    else:
        if dims.tp > 1 or dims.ep > 1 or dims.cp > 1:  # ep's all-to-all, cp's exchanges: traced with TP's
            trace = tp_trace(spec, res, result.mesh, _builder(result), shape.seq_len,
                             shape.micro_batch, param)
        else:
            trace = TPTrace(Counter(), [], None)
        comm = dict(collectives=rows(trace, _fsdp(result, param, reduce), step, dims))
    result.tp_trace = trace
    by_module: dict[tuple, list[int]] = {}
    for (kind, _dim, bw, nbytes, module), n in trace.counts.items():
        a = by_module.setdefault((module, "backward" if bw else "forward", kind), [0, 0])
        n *= step.count(module)
        a[0] += n
        a[1] += n * step.nbytes(module, nbytes)
    if dims.ep > 1:
        comm["ep_all_to_all"] = _ep_bounds(result, param.itemsize, parts)
    result.extra["comm_per_step"] = dict(
        grad_accum=shape.grad_accum, **comm,
        tp_by_module=[{"module": m, "pass": p, "kind": k, "count": v[0], "bytes": v[1]}
                      for (m, p, k), v in sorted(by_module.items())],
        traced_depths=trace.depths, repeated_blocks=trace.blocks)
    if minimum:
        result.extra["comm_minimum"] = _minimum(result, trace, step, param.itemsize, parts)
        if "ep_all_to_all" in comm:  # the minimum's EP term: each token to each remote rank once
            a2a = comm["ep_all_to_all"]
            result.extra["comm_minimum"]["ep"] = dict(
                mesh_dim="ep", wire_bytes=a2a["minimum_wire_bytes"],
                measured_wire_bytes=a2a["hidden_wire_bytes"], ratio=a2a["over_minimum"])
    if minimum and dims.cp > 1 and spec.pipeline is None:
        result.extra["cp_minimum"] = _cp_minimum(result, trace, step, param.itemsize)


def _fsdp(result: DryRun, param: "torch.dtype", reduce: "torch.dtype") -> list[dict[str, Any]]:
    """A whole model's FSDP2 (and HSDP) collectives per step, from its units."""
    spec = result.plan.spec
    return fsdp_collectives(result.fsdp_units, spec.fsdp, result.step, result.resolved.dims,
                            param.itemsize, reduce.itemsize)


def fsdp_rows(result: DryRun, stage_cache: dict | None = None) -> list[list[dict[str, Any]]]:
    """The FSDP2 rows of ``comm_per_step`` (:func:`analyze_comm`'s, less its TP, ep, cp and
    p2p rows) for each pp rank (one without a pipeline), from arithmetic alone: no trace
    runs. ``stage_cache``: as :func:`analyze_comm`'s."""
    param, reduce = compute_dtypes(result)
    step = accumulation(result, param, reduce)
    if result.plan.spec.pipeline is not None:
        from .comm.stages import pipeline_fsdp_rows

        return pipeline_fsdp_rows(result, param, reduce, step, stage_cache)
    return [rows(TPTrace(Counter(), [], None), _fsdp(result, param, reduce), step,
                 result.resolved.dims)]


def traced_rows(result: DryRun) -> list[list[dict[str, Any]]]:
    """The rows of ``comm_per_step`` that its TP trace gives (TP's, ep's and cp's: not
    FSDP2's nor the pipeline's sends), for each pp rank (one without a pipeline)."""
    comm = result.extra["comm_per_step"]
    ranks = [r["collectives"] for r in comm["pp_ranks"]] if "pp_ranks" in comm \
        else [comm["collectives"]]
    return [[row for row in rows if row["source"] not in ("fsdp", "pp")] for rows in ranks]


def _ep_bounds(result: DryRun, e: int, stages: list | None = None) -> dict[str, Any]:
    """The experts' all-to-all per rank per step (:func:`tpplan.analysis.comm.experts.expert_all_to_all`):
    the balanced count and bytes, as traced, its worst case (every token choosing experts
    of one rank) and the minimum (each token to each distinct remote rank once). ``stages``:
    under pipeline stages, the reported pp rank's (``StageComm``): a rank dispatches for the
    experts modules of its own stages only."""
    from .comm.experts import expert_all_to_all, experts_modules

    res = result.resolved
    parts = [(result.model, res)] if stages is None else [(s.module, s.res) for s in stages]
    modules = [m for module, r in parts for m in experts_modules(module, r)]
    return expert_all_to_all(modules, res.dims, result.step, e, _recomputed(result))


def _recomputed(result: DryRun) -> set[str]:
    """Module paths inside the blocks activation checkpointing recomputes."""
    ac, res = result.plan.spec.activation_checkpointing, result.resolved
    if not ac.enabled:
        return set()
    blocks = tuple(b + "." for b in res.ac_blocks[::ac.every])
    return {p for p, _ in result.model.named_modules() if p.startswith(blocks)}


def accumulation(result: DryRun, param: "torch.dtype", reduce: "torch.dtype") -> Accumulation:
    """FSDP2 keeps gradients accumulated over micro-batches in ``reduce_dtype``."""
    k = result.step.grad_accum
    upcast = result.plan.spec.fsdp is not None and k > 1 and reduce != param
    return Accumulation(k, (reduce if upcast else param).itemsize, param.itemsize)


def _minimum(result: DryRun, trace: TPTrace, step: Accumulation, e: int,
             stages: list | None = None) -> dict[str, Any]:
    """The traced TP collectives per step against the Megatron minimum, kind by kind:
    ``extra`` lists every (kind, pass) that differs, with signed differences; ``verdict``
    says whether the plan moves more, as much or less than the minimum over the wire.
    ``stages``: a pipeline rank's stages (``StageComm``), whose minimum is summed."""
    spec, res, shape = result.plan.spec, result.resolved, result.step
    if res.dims.cp > 1:  # TP runs on each cp rank's part of the sequence
        shape = dataclasses.replace(shape, seq_len=shape.seq_len // res.dims.cp)
    if stages is None:
        counts, nbytes = megatron_minimum(result.model, res, spec, shape, e, step.grad_bytes)
        parts = [(result.model, res)]
    else:
        from .comm.stages import stage_minimum

        counts, nbytes = stage_minimum(stages, spec, shape, e, step.grad_bytes)
        parts = [(s.module, s.res) for s in stages]
    measured_n: Counter = Counter()
    measured_b: Counter = Counter()
    for (kind, dim, bw, b, module), n in trace.counts.items():
        if dim in ("ep", "cp"):  # the experts' all-to-all, cp's own traffic: not TP's, not Megatron's
            continue
        n *= step.count(module)
        measured_n[(kind, bw)] += n
        measured_b[(kind, bw)] += n * step.nbytes(module, b)
    tp = res.dims.tp
    minimum, extra = [], []
    for kind, bw in sorted(set(counts) | set(measured_n)):
        p = "backward" if bw else "forward"
        minimum.append({"kind": kind, "pass": p, "count": counts[(kind, bw)],
                        "bytes": nbytes[(kind, bw)]})
        dn = measured_n[(kind, bw)] - counts[(kind, bw)]
        db = measured_b[(kind, bw)] - nbytes[(kind, bw)]
        if dn or db:
            extra.append({"kind": kind, "pass": p, "count": dn, "bytes": db})
    wire = sum(wire_bytes(kd, b, tp) for (kd, _), b in nbytes.items())
    wire_measured = sum(wire_bytes(kd, b, tp) for (kd, _), b in measured_b.items())
    verdict = "at" if not extra else "above" if wire_measured > wire else \
        "below" if wire_measured < wire else "as much as"
    return dict(mesh_dim="tp", style="sequence parallel" if spec.uses_sequence_parallel
                else "tensor parallel", collectives=minimum, wire_bytes=wire,
                measured_wire_bytes=wire_measured, at_minimum=not extra, verdict=verdict,
                extra=extra, reasons=_reasons(parts, spec) if extra else [])


def _cp_minimum(result: DryRun, trace: TPTrace, step: Accumulation, e: int) -> dict[str, Any]:
    """Context parallelism's traced collectives per step beside its method's minimum."""
    from .comm.context import cp_verdict

    counts: Counter = Counter()
    nbytes: Counter = Counter()
    for (kind, dim, bw, b, module), n in trace.counts.items():
        if dim == "cp":
            counts[(kind, bw)] += n * step.count(module)
            nbytes[(kind, bw)] += n * step.count(module) * step.nbytes(module, b)
    spec = result.plan.spec  # a model as built: applying divides its head counts by tp
    return cp_verdict(build_model(spec.model, "meta"), spec, result.step, result.resolved.dims,
                      counts, nbytes, e)


def _reasons(parts: list, spec) -> list[dict[str, Any]]:
    """:func:`diagnose` on each part (the model, or a rank's stages), each reason once."""
    out: list[dict[str, Any]] = []
    for model, res in parts:
        out += [r for r in diagnose(model, res, spec) if r not in out]
    return out


ANALYSES: list[Analysis] = [("memory_per_rank", analyze_memory), ("comm_per_step", analyze_comm)]


def analyze_kernels(result: DryRun, profile: Callable[..., dict[str, Any]] | None = None) -> None:
    """``kernels``: the step's memory-bound kernels, traced (:func:`~tpplan.analysis.memory.kernels.kernel_profile`;
    priced by :func:`tpplan.analysis.cost.non_gemm.non_gemm_term`). Not in :data:`ANALYSES`:
    ``validate --device`` and ``search`` ask for it. Under a pipeline, each reported pp rank's
    stages, ``{stages: {index: profile}, ranks: {pp rank: [index]}}``. ``profile``: in place of
    ``kernel_profile``, with its signature (``search``'s cache, :mod:`tpplan.analysis.search.kernel_cache`)."""
    from .memory.kernels import kernel_profile

    profile = profile or kernel_profile
    spec = result.plan.spec
    if spec.pipeline is not None:
        from .memory.stages import stage_traces

        split, per_stage, _ = stage_traces(
            spec, result.mesh, lambda: build_model(spec.model, "meta"), result.step, result.resolution.dims,
            lambda *a, io: profile(*a, io=io))
        ranks = {s.rank: [t.index for t in split.of_rank(s.rank)] for s in split.stages if s.index in per_stage}
        result.extra["kernels"] = dict(stages=per_stage, ranks=ranks)
        return
    blocks, n_blocks = model_blocks(result)
    result.extra["kernels"] = profile(result.plan.spec, result.mesh, _builder(result), result.step,
                                      n_blocks, blocks)
