"""Numerics of a plan against one device: logits, loss and every gradient.

The parallel side runs the plan for real: N processes on a gloo CPU mesh, the same
``plan.apply`` the trainer uses. The reference is the same model (same seed) and the same
global batch on one device with no plan at all. Both run in ``eval()`` mode, so dropout
(random, and drawn differently on sharded tensors) does not blur the comparison; gradients
flow the same. Each data-parallel rank takes its slice of the batch; FSDP averages
gradients over them, which equals the reference's mean loss.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...api import Plan, load
from ...models import build_model
from ...models.moe_loss import aux_loss, micro_batch_aux, with_aux_loss
from ...plan.packing import packed_params
from ...parallel.context.sequence import shard_batch
from ...parallel.experts.module_list import gather_expert_lists
from ...parallel.freeze import apply_freeze
from ...parallel.lora.adapters import apply_lora, freeze_base
from ...parallel.mesh import dp_rank as data_parallel_rank
from ...parallel.tp.packed import to_model_order
from ...parallel.runtime import as_spawned_rank, spawn
from .comparison import Comparison, StepResult, compare, rel_err

__all__ = ["StepResult", "make_batch", "reference_step", "parallel_step", "parallel_steps",
           "compare", "Comparison", "rel_err", "worker_failure", "VerifyStep", "verify_step"]


def make_batch(vocab_size: int, batch: int, seq_len: int, seed: int) -> torch.Tensor:
    """(batch, seq_len + 1) random tokens: inputs are [:, :-1], targets [:, 1:]."""
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, vocab_size, (batch, seq_len + 1), generator=g)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def reference_step(plan: Plan, tokens: torch.Tensor, seed: int,
                   positions: torch.Tensor | None = None) -> StepResult:
    """Forward and backward of the plan's model on one device, no parallelism.
    ``positions`` (like ``tokens``): packed documents' positions, restarting at 0 at each."""
    torch.manual_seed(seed)
    model = build_model(plan.require_model(), device="cpu").eval()  # eval: dropout off on both sides
    if plan.spec.lora is not None:  # the same adapters (drawn from the same seed), unsplit
        apply_lora(plan.spec.lora, model, None, {}, plan.spec.train.seed)
        freeze_base(plan.spec.lora, model)
    apply_freeze(plan.freeze, model)  # what the plan freezes has no gradient on either side
    logits = _forward(model, tokens, positions)
    aux = micro_batch_aux(model, _forward, tokens, positions, plan.spec.train.micro_batch_size)
    loss = with_aux_loss(_loss(logits, tokens[:, 1:]), aux)  # a MoE's aux: per micro-batch
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return StepResult(logits.detach(), loss.item(), grads)


def _forward(model, tokens: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    pos = None if positions is None else positions[:, :-1]
    return model(tokens[:, :-1], **shard_batch(model, tokens, tokens, pos)[2])


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _step(rank: int, world: int, plan_path: str, overrides: Sequence[str],
          tokens: torch.Tensor, seed: int, out_dir: Path,
          positions: torch.Tensor | None = None) -> None:
    """One rank's forward and backward through the plan (through its pipeline schedule if it
    has one); the first tp and dp rank of each stage saves its full gradients, each tp
    group's first rank (on the last stage) its data-parallel slice of the logits."""
    plan = load(plan_path, overrides)
    torch.manual_seed(seed)
    model = build_model(plan.require_model(), device="cpu").eval()
    mesh = plan.build_mesh("cpu")
    dp = plan.parallel_dims(world).dp
    if plan.pipeline is not None:
        return _pipeline_step(plan, model, mesh, tokens, dp, out_dir, positions)
    _plain_step(plan, model, mesh, tokens, dp, out_dir, positions)


def _grads(models: list, named) -> dict[str, torch.Tensor]:
    """Full gradients by name: packed ones in the model's order, a split list's from each ep rank."""
    packed = {k: v for m in models for k, v in packed_params(m).items()}
    grads = {n: to_model_order(_full(p.grad), packed[n]) if n in packed else _full(p.grad)
             for n, p in named if p.grad is not None}
    return gather_expert_lists(models, grads)


def _plain_step(plan: Plan, model, mesh, tokens: torch.Tensor, dp: int, out_dir: Path,
                positions: torch.Tensor | None = None) -> None:
    dp_rank = data_parallel_rank(mesh)
    model = plan.apply(model, mesh)
    local = tokens.chunk(dp)[dp_rank]
    # below: under context parallelism, this rank's part of each sequence
    positions = None if positions is None else positions.chunk(dp)[dp_rank][:, :-1]
    inputs, targets, kwargs = shard_batch(model, local[:, :-1], local[:, 1:], positions)
    with plan.loss_context():
        logits = model(inputs, **kwargs)
        loss = with_aux_loss(_loss(logits, targets), aux_loss(model))
        loss.backward()
    grads = _grads([model], model.named_parameters())
    _save_output(model, mesh, dp_rank, _full(logits.detach()), _full(loss.detach()), out_dir)
    if dist.get_rank() == 0:
        torch.save(grads, out_dir / "grads0.pt")


def _save_output(model, mesh, dp_rank: int, logits: torch.Tensor, loss: torch.Tensor,
                 out_dir: Path) -> None:
    """This rank's data-parallel slice of the logits and its loss, saved by the first tp rank
    (under cp, of cp rank 0: the whole sequence's logits, the mean of the parts' means)."""
    cp = getattr(model, "context_parallel", None)
    if cp is not None:
        logits = cp.unshard(logits)
        dist.all_reduce(loss, group=cp.group)
        loss = loss / cp.cp
        if cp.rank != 0:
            return
    if mesh["tp"].get_local_rank() == 0:
        torch.save({"dp_rank": dp_rank, "logits": logits, "loss": loss.item()},
                   out_dir / f"rank{dist.get_rank()}.pt")


def _pipeline_step(plan: Plan, model, mesh, tokens: torch.Tensor, dp: int, out_dir: Path,
                   positions: torch.Tensor | None = None) -> None:
    """The step through the plan's pipeline schedule: the loss on the last stage, each
    stage's gradients saved by its first tp, dp and cp rank; positions to every stage."""
    dp_rank = data_parallel_rank(mesh)
    local = tokens.chunk(dp)[dp_rank]
    positions = None if positions is None else positions.chunk(dp)[dp_rank][:, :-1]

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # Each micro-batch adds its share of the mean over this rank's tokens: no grad scaling.
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                               reduction="sum") / count

    pipe = plan.apply_pipeline(model, mesh, loss_fn, device="cpu", scale_grads=False)
    inputs, targets, kwargs = shard_batch(pipe.modules[0], local[:, :-1], local[:, 1:], positions)
    count = targets.numel()  # this rank's tokens (its part of each sequence under cp)
    with plan.loss_context():
        out = pipe.step(inputs, target=targets, losses=(losses := []), **kwargs)
    grads = _grads(pipe.modules, pipe.named_parameters())
    cp = getattr(pipe.modules[0], "context_parallel", None)
    if mesh["tp"].get_local_rank() == 0 and dp_rank == 0 and (cp is None or cp.rank == 0):
        torch.save(grads, out_dir / f"grads{mesh['pp'].get_local_rank()}.pt")
    if pipe.is_last:
        loss = sum(_full(v.detach()) for v in losses)
        _save_output(pipe.modules[-1], mesh, dp_rank, _full(out.detach()), loss, out_dir)


def _quiet() -> None:
    import logging
    import warnings
    warnings.simplefilter("ignore")  # FSDP/DTensor advice on every rank drowns the table
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)


def _worker(rank: int, world: int, port: int, plan_path: str, overrides: Sequence[str],
            tokens: torch.Tensor, seed: int, out_dir: str) -> None:
    as_spawned_rank(rank, world, port)
    _quiet()
    try:
        _step(rank, world, plan_path, overrides, tokens, seed, Path(out_dir))
        dist.barrier()  # no rank tears gloo down while a peer still talks to it
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _jobs_worker(rank: int, world: int, port: int, jobs: list, out_dir: str) -> None:
    """Every job in turn in this one process: a job that fails on a rank is recorded as
    that rank's error line and the next job starts after a barrier."""
    as_spawned_rank(rank, world, port)
    _quiet()
    from datetime import timedelta

    from ...parallel.runtime import ensure_process_group

    ensure_process_group("cpu")
    try:
        for i, (plan_path, overrides, tokens, seed, *positions) in enumerate(jobs):
            job_dir = Path(out_dir) / f"job{i}"
            try:
                _step(rank, world, plan_path, overrides, tokens, seed, job_dir, *positions)
            except Exception as e:  # noqa: BLE001 - the job's result is its error line
                (job_dir / f"error{rank}.txt").write_text(_one_line(e))
            dist.monitored_barrier(timeout=timedelta(seconds=120))
    finally:
        dist.destroy_process_group()


def _one_line(e: BaseException) -> str:
    lines = [x for x in f"{type(e).__name__}: {e}".splitlines() if x.strip()]
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"


def _read(out: Path) -> StepResult:
    parts = [torch.load(p) for p in sorted(out.glob("rank*.pt"))]
    parts.sort(key=lambda d: d["dp_rank"])
    grads: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("grads*.pt")):  # one file per pipeline stage
        grads.update(torch.load(f))
    logits = torch.cat([d["logits"] for d in parts])
    loss = sum(d["loss"] for d in parts) / len(parts)
    return StepResult(logits, loss, grads)


def worker_failure(e: BaseException) -> str:
    """One line for a spawned rank's failure: which rank, and the last line of its error
    (the exception itself, not the multi-process traceback around it)."""
    rank = getattr(e, "error_index", None)
    text = str(e).strip().splitlines()
    last = next((x for x in reversed(text) if x.strip()), str(e)).strip()
    last = last.removeprefix("tpplan.plan.errors.PlanErrors: ")  # a plan's mistake: located
    return f"rank {rank} failed: {last}" if rank is not None else last


def parallel_step(plan_path: str, overrides: Sequence[str], world_size: int,
                  tokens: torch.Tensor, seed: int) -> StepResult:
    """The same step through the plan on ``world_size`` gloo processes. A rank that fails
    is one :class:`~tpplan.plan.errors.CommandError` line naming the rank and its error."""
    import torch.multiprocessing as mp

    from ...plan.errors import CommandError

    with tempfile.TemporaryDirectory(prefix="tpplan-verify-") as out:
        try:
            spawn(_worker, world_size, plan_path, list(overrides), tokens, seed, out)
        except mp.ProcessRaisedException as e:
            raise CommandError(worker_failure(e)) from None
        return _read(Path(out))


def parallel_steps(jobs: Sequence[tuple[str, Sequence[str], torch.Tensor, int]],
                   world_size: int) -> list[StepResult | str]:
    """Several plans' steps (``(plan_path, overrides, tokens, seed[, positions])`` each) in
    one spawn of ``world_size`` processes, so start-up is paid once: each job's result, or
    the error line it failed with."""
    with tempfile.TemporaryDirectory(prefix="tpplan-verify-") as out:
        for i in range(len(jobs)):
            (Path(out) / f"job{i}").mkdir()
        spawn(_jobs_worker, world_size, [(p, list(o), *rest) for p, o, *rest in jobs], out)
        results: list[StepResult | str] = []
        for i in range(len(jobs)):
            job = Path(out) / f"job{i}"
            errors = sorted(job.glob("error*.txt"))
            results.append(errors[0].read_text() if errors else _read(job))
        return results


@dataclass
class VerifyStep:
    """What verify runs: the plan loaded with its shrinking and step overrides, those
    overrides (the parallel side loads the plan with them too) and the global batch."""

    plan: Plan
    overrides: list[str]
    tokens: torch.Tensor


def verify_step(plan_path: str, nproc: int, overrides: Sequence[str] = (), layers: int = 2,
                seq_len: int = 16, batch_per_rank: int = 2, seed: int = 0,
                shrink: bool = True) -> VerifyStep:
    """The plan's model shrunk to a tiny one of the same architecture (every divisibility
    relation over tp kept), a step of ``batch_per_rank`` sequences per data-parallel rank,
    checked as the trainer checks it. :class:`PlanErrors` if the plan does not fit."""
    from ...models.introspect import shrink_overrides, token_ids

    plan = load(plan_path, overrides)
    dims = plan.parallel_dims(nproc)  # PlanErrors (exit 1) if the mesh does not fit
    pipe = plan.pipeline
    if pipe is not None:  # a block per stage at least; whole micro-batches per rank
        layers = max(layers, dims.pp * pipe.stages_per_rank)
        batch_per_rank = -(-batch_per_rank // pipe.microbatches) * pipe.microbatches
    shrunk = shrink_overrides(plan.require_model(), dims.tp, layers, seq_len) if shrink else []
    # The step verify runs, in the plan's own terms, so the trainer's checks apply to it
    # (under a pipeline the micro-batches are the schedule's).
    step = [f"train.seq_len={seq_len}", f"train.global_batch_size={batch_per_rank * dims.dp}"]
    if pipe is None:
        step.append(f"train.micro_batch_size={batch_per_rank}")
    every = shrunk + step + list(overrides)  # the user's --set wins
    plan = load(plan_path, every)
    shape = plan.step_shape(nproc)  # seq_len under SP: a located error, not a crash
    model = build_model(plan.require_model(), device="meta")
    plan.check(model, nproc)
    vocab = token_ids(model, plan.require_model())
    tokens = make_batch(vocab, shape.global_batch, shape.seq_len, seed)
    return VerifyStep(plan, every, tokens)
