"""Step time of ``tpplan train`` against the same torch calls written out by hand.

One run, 4 CPU processes (gloo), four rows, each side by side:

- ``train``: a 2×2 mesh (dp_shard 2 × tp 2), the debug Llama of ``plans/llama.yaml``
  (TP + SP + loss parallel + FSDP2);
- ``ep`` (``scripts/bench_ep.py``): a MoE layer at ep 4, tpplan's
  ``expert_parallel`` against the same all-to-all dispatch by hand, and the bytes each rank
  sends against the minimum;
- ``pipeline``: pp 2 × tp 2, the same model as ``plans/llama-3d.yaml`` cuts it (2 blocks
  per stage, 1F1B over 4 micro-batches, selective AC every 2nd block, FSDP2 units on the
  stage's dp_shard of 1), against ``PipelineStage`` + ``Schedule1F1B`` + the same
  ``parallelize_module``/``checkpoint``/``fully_shard`` calls written by hand;
- ``cp``: dp_shard 2 × cp 2, ``plans/llama-fsdp.yaml`` with ring context parallelism (load
  balanced) at 2,048 tokens, against the same attention written with ``torch.distributed``
  by hand (K/V all-gathered with autograd, SDPA under the global causal mask).

Rounds alternate the hand-written loop and ``tpplan.train.train`` inside the same processes
and process group (which goes first alternates too), so both see the same machine load; the
median step time of each (first steps of each round dropped) and their ratio are printed.

    OMP_NUM_THREADS=1 python scripts/bench_train.py [--rows train,pipeline,ep,cp] [--steps 12]

The hand-written side is what a user would write without tpplan: ``init_device_mesh``,
``parallelize_module`` with the styles spelled out, ``fully_shard`` per block and root,
AdamW + warmup/cosine, ``loss_parallel``, the global grad norm, one loss all-reduce per
step for logging (the tpplan loop logs loss and grad norm each step too).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PLAN = str(ROOT / "plans" / "llama.yaml")
PLAN_3D = str(ROOT / "plans" / "llama-3d.yaml")
PLAN_FSDP = str(ROOT / "plans" / "llama-fsdp.yaml")
MICROBATCHES = 4


class Blocks(torch.nn.ModuleDict):
    """A stage's blocks under their whole-model keys, iterated like a list (the built-in
    Llama's forward runs ``for layer in self.layers``); torchtitan keeps a ModuleDict too."""

    def __iter__(self):
        return iter(self._modules.values())


def _tp_block(block, tp) -> None:
    """Megatron TP + sequence parallelism on one Llama block, by hand (tp 2)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(block, tp, {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                        desired_input_layouts=(Replicate(), None)),
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                           desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    })
    block.attention.n_heads //= 2
    block.attention.n_kv_heads //= 2


def _materialize(model) -> None:
    """The meta model on the CPU, initialized as tpplan's seeded init does (seed 0)."""
    model.to_empty(device="cpu")
    model.init_buffers("cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = model.init_std(name)
            p.fill_(1.0) if std is None else p.normal_(0.0, std)


def _clip(params: list, max_norm: float, pp_group) -> None:
    """The global grad norm: per (mesh, placements) group, squares summed (and over pp when
    ``pp_group`` is given), then ``clip_grads_with_norm_``."""
    from torch.distributed.tensor import DTensor

    groups: dict = {}
    for p in params:
        key = (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else "local"
        groups.setdefault(key, []).append(p.grad)
    total = torch.zeros(())
    for grads in groups.values():
        n = torch.nn.utils.get_total_norm(grads)
        total += (n.full_tensor() if isinstance(n, DTensor) else n) ** 2
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total.sqrt())


def hand_pipeline(steps: int, seq_len: int, batch: int, lr: float, tokens: torch.Tensor) -> list:
    """pp 2 × tp 2 by hand: each rank builds the whole model on meta, deletes what its stage
    does not own (torchtitan's way), applies TP + SP, AC on the stage's first block,
    ``fully_shard`` units, wraps it in ``PipelineStage`` and runs ``Schedule1F1B``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        loss_parallel,
        parallelize_module,
    )
    from torch.utils.checkpoint import checkpoint

    from tpplan.models.llama import build

    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp_shard", "tp"))
    stage = mesh["pp"].get_local_rank()
    first, last = stage == 0, stage == 1
    with torch.device("meta"):
        model = build("debug")  # 4 blocks: 0-1 on stage 0 with the embedding, 2-3 with the head
    mine = Blocks({str(i): model.layers[i] for i in (range(0, 2) if first else range(2, 4))})
    model.layers = mine
    if not first:
        model.tok_embeddings = None
    if not last:
        model.norm, model.output = None, None
    tp = mesh["tp"]
    if first:
        parallelize_module(model.tok_embeddings, tp, RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1)))
    if last:
        parallelize_module(model.norm, tp, SequenceParallel())
        parallelize_module(model.output, tp, ColwiseParallel(input_layouts=Shard(1),
                                                             use_local_output=False))
    for block in mine:
        _tp_block(block, tp)
    ac = next(iter(mine))  # selective AC, every 2nd block: the stage's first
    ac.forward = lambda *a, _f=ac.forward, **k: checkpoint(_f, *a, use_reentrant=False, **k)
    dp = mesh["dp_shard"]
    if first:
        fully_shard(model.tok_embeddings, mesh=dp)
    for block in mine:
        fully_shard(block, mesh=dp)
    if last:
        fully_shard([model.norm, model.output], mesh=dp)
    fully_shard(model, mesh=dp)
    _materialize(model)
    count = batch * seq_len  # dp 1: the rank's share is the global batch

    def loss_fn(logits, targets):  # each micro-batch's share of the global mean
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                               reduction="sum") / count

    pipe = PipelineStage(model, stage, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = Schedule1F1B(pipe, n_microbatches=MICROBATCHES, loss_fn=loss_fn,
                            scale_grads=False)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / 10, 0.5 * (1 + math.cos(math.pi * s / steps))))
    g = torch.Generator().manual_seed(1)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        starts = torch.randint(0, tokens.numel() - seq_len - 1, (batch,), generator=g)
        x = tokens[starts[:, None] + torch.arange(seq_len + 1)]
        losses: list = []
        with loss_parallel():
            if first:
                schedule.step(x[:, :-1])
            else:
                schedule.step(target=x[:, 1:], losses=losses)
        _clip(params, 1.0, mesh["pp"].get_group())
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss = sum(v.detach().full_tensor() if hasattr(v, "full_tensor") else v.detach()
                   for v in losses) if losses else torch.zeros(())
        dist.all_reduce(loss)
        loss.item()
        times.append(time.perf_counter() - t0)
    return times


def _sharded(model, mesh, lr: float, steps: int):
    """``fully_shard`` per block, the embedding, norm + head, the root; materialized; AdamW
    with warmup then cosine: (optimizer, scheduler)."""
    from torch.distributed.fsdp import fully_shard

    for part in [model.tok_embeddings, *model.layers]:
        fully_shard(part, mesh=mesh)
    fully_shard([model.norm, model.output], mesh=mesh)
    fully_shard(model, mesh=mesh)
    _materialize(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / 10, 0.5 * (1 + math.cos(math.pi * s / steps))))
    return opt, sched


def _timed(steps: int, opt, sched, tokens: torch.Tensor, seq_len: int, batch: int, first: int,
           per: int, forward_backward) -> list:
    """Each step: ``batch`` random windows of ``seq_len + 1`` tokens (the same on every rank),
    rows ``first`` to ``first + per`` to ``forward_backward`` (-> the loss, gradients
    clipped), AdamW and the schedule, one loss all-reduce for logging. Its wall times."""
    g = torch.Generator().manual_seed(1)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        starts = torch.randint(0, tokens.numel() - seq_len - 1, (batch,), generator=g)
        x = tokens[starts[:, None] + torch.arange(seq_len + 1)][first:first + per]
        loss = forward_backward(x)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.detach()
        dist.all_reduce(loss)
        loss.item()
        times.append(time.perf_counter() - t0)
    return times


def hand_written(steps: int, seq_len: int, batch: int, lr: float, tokens: torch.Tensor,
                 naive_clip: bool = False) -> list:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        loss_parallel,
        parallelize_module,
    )

    from tpplan.models.llama import build

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = build("debug")
    parallelize_module(model, mesh["tp"], {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
    })
    for block in model.layers:
        _tp_block(block, mesh["tp"])
    opt, sched = _sharded(model, mesh["dp"], lr, steps)
    dp_rank, per = mesh["dp"].get_local_rank(), batch // 2

    def forward_backward(x):
        with loss_parallel():
            loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1).float(), x[:, 1:].flatten())
            loss.backward()
        if naive_clip:  # one norm over mixed placements: DTensor redistributes per parameter
            norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), 1.0, norm)
        else:
            _clip(list(model.parameters()), 1.0, None)
        return loss.full_tensor()

    return _timed(steps, opt, sched, tokens, seq_len, batch, dp_rank * per, per, forward_backward)


def hand_cp(steps: int, seq_len: int, batch: int, lr: float, tokens: torch.Tensor) -> list:
    """dp_shard 2 × cp 2 by hand: each cp rank the head and tail chunk of every sequence
    (rotary positions its global ones), K and V all-gathered over cp with autograd
    (``all_gather_tensor_autograd``; ``torch.distributed.nn.functional.all_gather``'s backward
    fails on a gloo subgroup in torch 2.13), SDPA under the causal mask of the global
    indices, FSDP2 over the four ranks."""
    from torch.distributed._functional_collectives import all_gather_tensor_autograd
    from torch.distributed.device_mesh import init_device_mesh

    from tpplan.models.llama import build

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    group, r = mesh["cp"].get_group(), mesh["cp"].get_local_rank()
    c = seq_len // 4  # 2·cp chunks: rank r holds chunks r and 3 - r

    def chunks(rank):
        return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                          torch.arange((3 - rank) * c, (4 - rank) * c)])

    index, every = chunks(r), torch.cat([chunks(0), chunks(1)])
    mask = index[:, None] >= every[None, :]  # keys in rank order, as all_gather returns them

    def attend(q, k, v, positions=None):
        k = all_gather_tensor_autograd(k.contiguous(), 2, group)
        v = all_gather_tensor_autograd(v.contiguous(), 2, group)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    with torch.device("meta"):
        model = build("debug")
    for block in model.layers:
        block.attention.attend = attend
    opt, sched = _sharded(model, mesh._flatten("dp_cp"), lr, steps)
    dp_rank, per = mesh["dp"].get_local_rank(), batch // 2

    def forward_backward(x):
        logits = model(x[:, :-1][:, index], positions=index.expand(per, -1))
        loss = F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:][:, index].flatten())
        loss.backward()
        _clip(list(model.parameters()), 1.0, None)
        return loss

    return _timed(steps, opt, sched, tokens, seq_len, batch, dp_rank * per, per, forward_backward)


def worker(rank: int, world: int, port: int, args, out: str) -> None:
    from tpplan.parallel.runtime import as_spawned_rank

    as_spawned_rank(rank, world, port)
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    import tpplan.train
    from tpplan.train.data import load_corpus

    dist.init_process_group("gloo")
    tokens = load_corpus(None, 4_000_000).tokens
    sets = [f"train.steps={args.steps}", f"train.seq_len={args.seq_len}",
            f"train.global_batch_size={args.batch}", f"train.lr={args.lr}",
            "checkpoint.enabled=false", "metrics.log_interval=1000", f"metrics.run_dir={out}/run"]
    rows = {
        "train": (PLAN, [*sets, f"train.micro_batch_size={args.batch // 2}"],
                  lambda: hand_written(args.steps, args.seq_len, args.batch, args.lr, tokens,
                                       args.naive_clip)),
        "pipeline": (PLAN_3D, [*sets, "mesh.pp=2", "mesh.tp=2", "mesh.dp_shard=1",
                               "pipeline.schedule=1f1b", f"pipeline.microbatches={MICROBATCHES}",
                               "pipeline.split=auto", "activation_checkpointing.mode=selective",
                               "activation_checkpointing.every=2"],
                     lambda: hand_pipeline(args.steps, args.seq_len, args.batch, args.lr, tokens)),
        "cp": (PLAN_FSDP, [*sets, "mesh.cp=2", "context_parallel={method: ring, load_balance: true}",
                           f"train.seq_len={args.cp_seq_len}", f"train.global_batch_size={args.cp_batch}"],
               lambda: hand_cp(args.steps, args.cp_seq_len, args.cp_batch, args.lr, tokens)),
    }
    skip = 3  # first steps warm allocators and caches
    for row in args.rows.split(","):
        if row == "ep":  # the experts' dispatch: its own bench (scripts/bench_ep.py)
            from bench_ep import ep_row

            ep_row(rank, args.steps, args.rounds, 2048)
            continue
        plan, plan_sets, by_hand = rows[row]
        hand, tp = [], []
        for r in range(args.rounds):
            # Alternate which side goes first, so neither always runs on a warmer process.
            for side in ("hand", "tpplan") if r % 2 == 0 else ("tpplan", "hand"):
                if side == "hand":
                    hand += by_hand()[skip:]
                else:
                    summary = tpplan.train.train(plan, plan_sets, overwrite=True,
                                                 device_type="cpu")
                    tp += summary["step_times"][skip:]
        if rank == 0:
            h, t = statistics.median(hand), statistics.median(tp)
            print(f"\n[{row}] hand-written: median step {h * 1e3:.1f} ms over {len(hand)} steps")
            print(f"[{row}] tpplan train: median step {t * 1e3:.1f} ms over {len(tp)} steps")
            print(f"[{row}] ratio tpplan / hand-written: {t / h:.3f}x", flush=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="train,pipeline,ep,cp",
                   help="comma-separated: train (dp_shard 2 × tp 2), pipeline (pp 2 × tp 2), "
                        "ep (a MoE layer at ep 4: scripts/bench_ep.py), cp (dp_shard 2 × cp 2, ring)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--naive-clip", action="store_true",
                   help="hand-written side clips with one get_total_norm over all grads")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--cp-seq-len", type=int, default=2048, help="the cp row's sequence")
    p.add_argument("--cp-batch", type=int, default=4, help="the cp row's global batch")
    args = p.parse_args()
    from tpplan.parallel.runtime import spawn

    with tempfile.TemporaryDirectory(prefix="tpplan-bench-") as out:
        spawn(worker, 4, args, out)


if __name__ == "__main__":
    main()
