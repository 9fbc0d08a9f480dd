"""LoRA steps on gloo ranks against ``peft`` on one device (tests/test_lora.py).

The reference is ``peft``'s own LoRA on the same model (same seed, same batch), its A and
B drawn at random (B non-zero, so A has a gradient) and copied into tpplan's adapters on
every rank after ``plan.apply``. Each rank then runs a forward and backward (through the
pipeline schedule when the plan has one) and two AdamW steps, and reports: the loss, every
adapter gradient gathered whole, which parameters have a gradient or optimizer state, and
whether every frozen base weight is bit-identical after the steps.
"""

from __future__ import annotations

import re
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import tpplan
from tpplan.models import build_model
from tpplan.parallel.lora.adapters import lora_targets, saved_modules
from tpplan.parallel.mesh import dp_rank as data_parallel_rank
from tpplan.parallel.runtime import as_spawned_rank, ensure_process_group, spawn
from tpplan.train.optim import make_optimizer
from tpplan.train.pretrained import load_adapter


def tpplan_name(peft_name: str) -> str:
    """``base_model.model.x.q_proj.lora_A.default.weight`` -> ``x.q_proj.lora_A.weight``."""
    name = peft_name.removeprefix("base_model.model.")
    return name.replace(".modules_to_save.default.", ".").replace(".default.", ".")


def peft_reference(plan_path: str, overrides, tokens: torch.Tensor, seed: int, hf: bool):
    """(loss, {tpplan name: gradient}, {tpplan name: initial value}) of peft's LoRA on one
    device: ``get_peft_model`` for a transformers model, ``inject_adapter_in_model`` for
    tpplan's own Llama."""
    from peft import LoraConfig, get_peft_model, inject_adapter_in_model

    plan = tpplan.load(plan_path, overrides)
    spec = plan.spec.lora
    torch.manual_seed(seed)
    model = build_model(plan.model, device="cpu").eval()
    paths = [p for p, _ in model.named_modules()]
    targets = "|".join(re.escape(p) for p in lora_targets(spec, paths))
    saved = saved_modules(spec, paths)
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,  # eval: off
                        target_modules=f"(?:{targets})", use_rslora=spec.rslora,
                        modules_to_save=saved or None)
    model = get_peft_model(model, config) if hf else inject_adapter_in_model(config, model)
    model.eval()  # peft's added modules (its dropout) are made in train mode
    g = torch.Generator().manual_seed(seed + 7)
    init = {}
    for name, p in model.named_parameters():
        if p.requires_grad and ("lora_" in name or "modules_to_save" in name):
            with torch.no_grad():
                if "lora_" in name:
                    p.normal_(0.0, 0.05, generator=g)
            init[tpplan_name(name)] = p.detach().clone()
    out = model(input_ids=tokens[:, :-1]) if hf else model(tokens[:, :-1])
    logits = out if isinstance(out, torch.Tensor) else out.logits
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    grads = {tpplan_name(n): p.grad.clone() for n, p in model.named_parameters()
             if p.grad is not None}
    return loss.item(), grads, init


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _job(plan_path: str, overrides, tokens, seed: int, init: dict, out: Path) -> None:
    plan = tpplan.load(plan_path, overrides)
    torch.manual_seed(seed)
    model = build_model(plan.model, device="cpu").eval()
    mesh = plan.build_mesh("cpu")
    dims = plan.parallel_dims(dist.get_world_size())
    dp_rank = data_parallel_rank(mesh)
    local = tokens.chunk(dims.dp)[dp_rank]
    count = local[:, 1:].numel()
    pipe = None
    if plan.pipeline is not None:
        def loss_fn(logits, targets):
            return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                                   reduction="sum") / count

        pipe = plan.apply_pipeline(model, mesh, loss_fn, device="cpu", scale_grads=False)
        parts = pipe.modules
    else:
        parts = [plan.apply(model, mesh)]
    named = [(n, p) for part in parts for n, p in part.named_parameters()]
    load_adapter(init, parts)  # peft's A and B (and modules_to_save), each rank its slice

    def step():
        with plan.loss_context():
            if pipe is not None:
                losses: list = []
                pipe.step(local[:, :-1], target=local[:, 1:], losses=losses)
                return float(sum(_full(v.detach()) for v in losses)) if pipe.is_last else None
            logits = parts[0](local[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), local[:, 1:].flatten())
            loss.backward()
            return _full(loss.detach()).item()

    frozen = {n: _full(p.detach()).clone() for n, p in named if not p.requires_grad}
    loss = step()
    grads = {n: _full(p.grad) for n, p in named if p.grad is not None}
    made = [make_optimizer(part, plan.spec.train) for part in parts]
    for _ in range(2):
        for opt, _ in made:
            opt.step()
            opt.zero_grad(set_to_none=True)
        step()
    with_state = sorted(n for (opt, _), part in zip(made, parts) for n, p in part.named_parameters()
                        if opt.state.get(p))
    same = all(torch.equal(_full(p.detach()), frozen[n]) for n, p in named if n in frozen)
    first = mesh["tp"].get_local_rank() == 0
    result = {"dp_rank": dp_rank, "loss": loss, "frozen_same": same, "n_frozen": len(frozen),
              "with_grad": sorted(grads), "with_state": with_state}
    if first and dp_rank == 0:
        result["grads"] = grads
    if plan.spec.lora.dropout and pipe is None:
        result["dropout_losses"] = _eval_train_eval(parts[0], plan, local)
    torch.save(result, out / f"rank{dist.get_rank()}.pt")


def _eval_train_eval(model, plan, local) -> list[float]:
    """The loss of one forward in eval mode, two in train mode, one in eval mode again:
    the adapters' dropout is off in eval (the first and last equal), on in train (each
    forward draws its masks: they differ from eval's and from each other)."""
    out = []
    for train in (False, True, True, False):
        model.train(train)
        with torch.no_grad(), plan.loss_context():
            logits = model(local[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), local[:, 1:].flatten())
            out.append(_full(loss).item())
    return out


def _worker(rank: int, world: int, port: int, jobs: list, out_dir: str) -> None:
    as_spawned_rank(rank, world, port)
    import logging
    import warnings

    warnings.simplefilter("ignore")
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    ensure_process_group("cpu")
    try:
        for i, (plan_path, overrides, tokens, seed, init) in enumerate(jobs):
            job = Path(out_dir) / f"job{i}"
            try:
                _job(plan_path, overrides, tokens, seed, init, job)
            except Exception as e:  # noqa: BLE001 - the job's result is its error
                (job / f"error{rank}.txt").write_text(f"{type(e).__name__}: {e}")
            dist.monitored_barrier(timeout=timedelta(seconds=120))
    finally:
        dist.destroy_process_group()


def run_jobs(jobs: list, world: int) -> list:
    """Each job ``(plan, overrides, tokens, seed, init)`` on ``world`` gloo ranks, one
    spawn: a list of per-rank result dicts, or the error text of a failed job."""
    with tempfile.TemporaryDirectory(prefix="tpplan-lora-") as out:
        for i in range(len(jobs)):
            (Path(out) / f"job{i}").mkdir()
        spawn(_worker, world, jobs, out)
        results = []
        for i in range(len(jobs)):
            job = Path(out) / f"job{i}"
            errors = sorted(job.glob("error*.txt"))
            results.append(errors[0].read_text() if errors else
                           [torch.load(p, weights_only=False) for p in sorted(job.glob("rank*.pt"))])
        return results
