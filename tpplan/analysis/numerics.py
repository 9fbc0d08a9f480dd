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

__all__ = ["StepResult", "make_batch", "reference_step", "parallel_step", "compare", "Comparison",
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


def _worker(rank: int, world: int, port: int, plan_path: str, overrides: Sequence[str],
            tokens: torch.Tensor, seed: int, out_dir: str) -> None:
    as_spawned_rank(rank, world, port)
    import logging
    import warnings

    warnings.simplefilter("ignore")  # FSDP/DTensor advice on every rank drowns the table
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    plan = load(plan_path, overrides)
    torch.manual_seed(seed)
    model = build_model(plan.model, device="cpu").eval()
    mesh = plan.build_mesh("cpu")
    try:
        model = plan.apply(model, mesh)
        dims = plan.parallel_dims(world)
        dp_rank = data_parallel_rank(mesh)
        local = tokens.chunk(dims.dp)[dp_rank]
        with plan.loss_context():
            logits = model(local[:, :-1])
            loss = _loss(logits, local[:, 1:])
            loss.backward()
        logits, loss = _full(logits.detach()), _full(loss.detach())
        grads = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        if mesh["tp"].get_local_rank() == 0:
            torch.save({"dp_rank": dp_rank, "logits": logits, "loss": loss.item()},
                       Path(out_dir) / f"rank{rank}.pt")
        if rank == 0:
            torch.save(grads, Path(out_dir) / "grads.pt")
        dist.barrier()  # no rank tears gloo down while a peer still talks to it
    finally:
        dist.destroy_process_group()


def parallel_step(plan_path: str, overrides: Sequence[str], world_size: int,
                  tokens: torch.Tensor, seed: int) -> StepResult:
    """The same step through the plan on ``world_size`` gloo processes."""
    with tempfile.TemporaryDirectory(prefix="tpplan-verify-") as out:
        spawn(_worker, world_size, plan_path, list(overrides), tokens, seed, out)
        parts = [torch.load(p) for p in sorted(Path(out).glob("rank*.pt"))]
        parts.sort(key=lambda d: d["dp_rank"])
        grads = torch.load(Path(out) / "grads.pt")
    logits = torch.cat([d["logits"] for d in parts])
    loss = sum(d["loss"] for d in parts) / len(parts)
    return StepResult(logits, loss, grads)


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
