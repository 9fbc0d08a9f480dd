"""Numerics of a plan against one device: logits, loss and every gradient.

The parallel side runs the plan for real: N processes on a gloo CPU mesh, the same
``plan.apply`` the trainer uses. The reference is the same model (same seed) and the same
global batch on one device with no plan at all. Both run in ``eval()`` mode, so dropout
(random, and drawn differently on sharded tensors) does not blur the comparison; gradients
flow the same. Each data-parallel rank takes its slice of
the batch; FSDP averages gradients over them, which equals the reference's mean loss.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..api import Plan, load
from ..models import build_model
from ..parallel.freeze import apply_freeze
from ..parallel.mesh import dp_rank as data_parallel_rank
from ..parallel.runtime import as_spawned_rank, spawn

__all__ = ["StepResult", "make_batch", "reference_step", "parallel_step", "parallel_steps", "compare", "Comparison",
           "rel_err"]


@dataclass
class StepResult:
    logits: torch.Tensor  # (B, S, V), the whole global batch
    loss: float
    grads: dict[str, torch.Tensor]  # parameter name -> full gradient


def make_batch(vocab_size: int, batch: int, seq_len: int, seed: int) -> torch.Tensor:
    """(batch, seq_len + 1) random tokens: inputs are [:, :-1], targets [:, 1:]."""
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, vocab_size, (batch, seq_len + 1), generator=g)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def reference_step(plan: Plan, tokens: torch.Tensor, seed: int) -> StepResult:
    """Forward and backward of the plan's model on one device, no parallelism."""
    torch.manual_seed(seed)
    model = build_model(plan.model, device="cpu").eval()  # eval: dropout off on both sides
    apply_freeze(plan.freeze, model)  # what the plan freezes has no gradient on either side
    logits = model(tokens[:, :-1])
    loss = _loss(logits, tokens[:, 1:])
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return StepResult(logits.detach(), loss.item(), grads)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _plain_step(plan: Plan, model, mesh, tokens: torch.Tensor, dp: int, out_dir: Path) -> None:
    dp_rank = data_parallel_rank(mesh)
    model = plan.apply(model, mesh)
    local = tokens.chunk(dp)[dp_rank]
    with plan.loss_context():
        logits = model(local[:, :-1])
        loss = _loss(logits, local[:, 1:])
        loss.backward()
    logits, loss = _full(logits.detach()), _full(loss.detach())
    grads = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    if mesh["tp"].get_local_rank() == 0:
        torch.save({"dp_rank": dp_rank, "logits": logits, "loss": loss.item()},
                   out_dir / f"rank{dist.get_rank()}.pt")
    if dist.get_rank() == 0:
        torch.save(grads, out_dir / "grads0.pt")


def _pipeline_step(plan: Plan, model, mesh, tokens: torch.Tensor, dp: int, out_dir: Path) -> None:
    """The step through the plan's pipeline schedule: the loss on the last stage, each
    stage's gradients saved by its first tp and dp rank."""
    dp_rank = data_parallel_rank(mesh)
    local = tokens.chunk(dp)[dp_rank]
    count = local[:, 1:].numel()

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # Each micro-batch adds its share of the rank's mean: no grad scaling needed.
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                               reduction="sum") / count

    pipe = plan.apply_pipeline(model, mesh, loss_fn, device="cpu", scale_grads=False)
    losses: list[torch.Tensor] = []
    with plan.loss_context():
        out = pipe.step(local[:, :-1], target=local[:, 1:], losses=losses)
    grads = {n: _full(p.grad) for n, p in pipe.named_parameters() if p.grad is not None}
    first_in_slice = mesh["tp"].get_local_rank() == 0
    if first_in_slice and dp_rank == 0:
        torch.save(grads, out_dir / f"grads{mesh['pp'].get_local_rank()}.pt")
    if pipe.is_last:
        logits = _full(out.detach())
        loss = sum(_full(v.detach()) for v in losses)
        if first_in_slice:
            torch.save({"dp_rank": dp_rank, "logits": logits, "loss": float(loss)},
                       out_dir / f"rank{dist.get_rank()}.pt")


def _worker(rank: int, world: int, port: int, plan_path: str, configs: list[list[str]],
            tokens: torch.Tensor, seed: int, out_dir: str) -> None:
    as_spawned_rank(rank, world, port)
    import logging
    import warnings

    warnings.simplefilter("ignore")  # FSDP/DTensor advice on every rank drowns the table
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    try:
        for i, overrides in enumerate(configs):  # one process group for every config
            plan = load(plan_path, overrides)
            torch.manual_seed(seed)
            model = build_model(plan.model, device="cpu").eval()
            mesh = plan.build_mesh("cpu")
            out = Path(out_dir) / f"config{i}"
            out.mkdir(exist_ok=True)
            step = _pipeline_step if plan.pipeline is not None else _plain_step
            step(plan, model, mesh, tokens, plan.parallel_dims(world).dp, out)
            dist.barrier()  # no rank tears gloo down while a peer still talks to it
    finally:
        dist.destroy_process_group()


def _collect(out: Path) -> StepResult:
    parts = [torch.load(p) for p in sorted(out.glob("rank*.pt"))]
    parts.sort(key=lambda d: d["dp_rank"])
    grads: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("grads*.pt")):
        grads.update(torch.load(f))
    logits = torch.cat([d["logits"] for d in parts])
    loss = sum(d["loss"] for d in parts) / len(parts)
    return StepResult(logits, loss, grads)


def parallel_steps(plan_path: str, configs: Sequence[Sequence[str]], world_size: int,
                   tokens: torch.Tensor, seed: int) -> list[StepResult]:
    """The same step through the plan under each list of overrides in ``configs``, all in
    one spawn of ``world_size`` gloo processes (a pipeline plan runs its schedule)."""
    with tempfile.TemporaryDirectory(prefix="tpplan-verify-") as out:
        spawn(_worker, world_size, plan_path, [list(c) for c in configs], tokens, seed, out)
        return [_collect(Path(out) / f"config{i}") for i in range(len(configs))]


def parallel_step(plan_path: str, overrides: Sequence[str], world_size: int,
                  tokens: torch.Tensor, seed: int) -> StepResult:
    """The same step through the plan on ``world_size`` gloo processes."""
    return parallel_steps(plan_path, [overrides], world_size, tokens, seed)[0]


@dataclass
class Comparison:
    rows: list[tuple[str, float]]  # (what, worst relative error)
    tolerance: float

    @property
    def ok(self) -> bool:
        return all(err <= self.tolerance for _, err in self.rows)

    @property
    def failures(self) -> list[tuple[str, float]]:
        return [(w, e) for w, e in self.rows if e > self.tolerance]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a-b| / max(|b|, floor): the floor keeps gradients that are zero in exact
    arithmetic (an attention key bias cannot change softmax) from dividing by rounding noise."""
    if a.shape != b.shape:
        return float("inf")
    scale = max(b.abs().max().item(), 1e-3)
    return (a.float() - b.float()).abs().max().item() / scale


def compare(ref: StepResult, par: StepResult, tolerance: float = 1e-4) -> Comparison:
    rows = [("logits", rel_err(par.logits, ref.logits)),
            ("loss", abs(par.loss - ref.loss) / max(abs(ref.loss), 1e-3))]
    for name, g in ref.grads.items():
        other = par.grads.get(name)
        rows.append((f"grad {name}", float("inf") if other is None else rel_err(other, g)))
    for name in par.grads.keys() - ref.grads.keys():
        rows.append((f"grad {name} (not in the reference)", float("inf")))
    return Comparison(rows, tolerance)
