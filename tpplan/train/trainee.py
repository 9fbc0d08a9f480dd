"""What a run trains on this rank, ready for its first step: the model (or this rank's
pipeline stages) parallelized through the public API, materialized and initialized (seeded,
pretrained, or as the checkpoint it resumes), with its optimizers and learning-rate schedules;
and a checkpoint of all of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from .. import checkpoint as ckpt
from ..models import init_weights, materialize
from ..models.init import init_adapters
from ..plan.specs import ModelSpec
from ..parallel.experts.module_list import expert_list_groups
from .optim import lr_lambda, make_optimizer
from .pretrained import load as load_pretrained
from .pretrained import load_adapter
from .resume import Claim
from .setup import Prepared, TrainError
from .stepper import make_stepper

__all__ = ["Trainee", "build_trainee", "load_checkpoint", "save_checkpoint"]


@dataclass
class Trainee:
    stepper: Callable[..., torch.Tensor]  # one optimizer step's forward and backward
    parts: list[nn.Module]  # the model, or this rank's pipeline stages
    optimizers: list[torch.optim.Optimizer]  # one per part
    schedules: list[torch.optim.lr_scheduler.LambdaLR]  # one per optimizer
    trained: list[nn.Parameter]  # what `freeze` leaves training, over every part
    ep_local: dict[int, Any]  # experts of a list: each on its ep rank only
    init_method: str  # how the weights were set, for the header


def _init(parts: list, seed: int, device: torch.device, spec: ModelSpec | None = None) -> str:
    """Seeded init of each part: parameters are seeded by their whole-model name, so the
    numbers do not depend on the pipeline split (those only a constructor writes: as the
    plain build under ``seed`` does, ``spec``'s constructor replayed)."""
    return [init_weights(part, seed, device, spec) for part in parts][0]


def _initialize(prep: Prepared, claimed: Claim, parts: list[nn.Module], device: torch.device) -> str:
    """Set the weights of ``parts`` and say how: seeded, pretrained (LoRA adapters drawn or
    loaded), or seeded and then overwritten by the checkpoint it resumes."""
    plan, t = prep.plan, prep.plan.train
    lora = plan.lora is not None  # checkpoints hold what trains; the base is loaded as at start
    if claimed.resume_from is not None and not (lora and prep.pretrained is not None):
        init_method = f"{_init(parts, t.seed, device, plan.model)} init, then the checkpoint's"
    elif prep.pretrained is not None:
        init_method = load_pretrained(prep.pretrained, parts[0])
        if sum(init_adapters(part, t.seed) for part in parts):  # not in the HF folder
            init_method += ", LoRA adapters drawn"
    else:
        init_method = _init(parts, t.seed, device, plan.model) + " init"
    if prep.adapter is not None and claimed.resume_from is None:
        load_adapter(prep.adapter, parts)
        init_method += f", LoRA adapters from {plan.model.adapter}"
    return init_method


def build_trainee(prep: Prepared, claimed: Claim, mesh, device: torch.device) -> Trainee:
    """Parallelize, materialize and initialize the model, make its optimizers and schedules,
    and load the checkpoint ``claimed`` resumes from, if any."""
    plan, dims, t = prep.plan, prep.dims, prep.plan.train
    # FSDP2 averages gradients over dp ranks: scale them back to the global mean's (.evaluate)
    # FSDP2 averages over dp_shard × cp: each rank's loss is its tokens' part of the sum
    dp_scale = dims.dp * dims.cp if plan.fsdp is not None else 1
    stepper = make_stepper(plan, prep.model, mesh, device, prep.step.micro_batch, prep.step.grad_accum,
                           dp_scale, dims.dp)
    parts = stepper.parts
    for part in parts:
        materialize(part, device)
    init_method = _initialize(prep, claimed, parts, device)
    made = [make_optimizer(part, t) for part in parts]  # over what `freeze` leaves training
    optimizers = [o for o, _ in made]
    trained = [p for _, ps in made for p in ps]
    ep_local = expert_list_groups(parts)
    schedules = [torch.optim.lr_scheduler.LambdaLR(
        o, lambda s: lr_lambda(s, t.warmup_steps, t.steps, t.lr, t.min_lr)) for o in optimizers]
    trainee = Trainee(stepper, parts, optimizers, schedules, trained, ep_local, init_method)
    if claimed.resume_from is not None:
        load_checkpoint(prep, trainee, claimed.resume_from)
    return trainee


def load_checkpoint(prep: Prepared, trainee: Trainee, path: Path) -> None:
    """Set ``trainee`` (weights, optimizer state, schedules, RNG) to the checkpoint ``path``.
    Collective over the run's ranks (DCP)."""
    state = ckpt.load(path, trainee.parts, trainee.optimizers, trained_only=prep.plan.lora is not None)
    for schedule in trainee.schedules:
        schedule.load_state_dict(state["schedule"])
    torch.set_rng_state(state["rng"])


def save_checkpoint(prep: Prepared, trainee: Trainee, step: int, reason: str, shapes: dict,
                    last_saved: Path | None) -> Path:
    """A checkpoint of ``trainee`` after ``step``; a failed save says whether ``last_saved``
    is still there to resume from. ``shapes``: the whole model's, before it was parallelized."""
    plan, lora = prep.plan, prep.plan.lora is not None
    state = {"step": step, "schedule": trainee.schedules[0].state_dict(), "data_step": step,
             "rng": torch.get_rng_state(), "model_shapes": shapes,
             "mesh": prep.dims.as_dict(), "plan": plan.source, "reason": reason}
    if lora:
        state["lora_base"] = prep.lora_base
    try:
        return ckpt.save(prep.ckpt_dir, step, trainee.parts, trainee.optimizers, state, plan.checkpoint.keep,
                         trained_only=lora)
    except ckpt.SaveFailed as e:
        kept = f"the previous checkpoint {last_saved} is intact" if last_saved else \
            "no earlier checkpoint exists"
        raise TrainError(f"{e}; {kept}") from None
