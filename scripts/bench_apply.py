"""How much does the plan cost? ``plan.apply`` against the same torch calls written by hand.

Both sides parallelize the 70b Llama on the meta device at world size 1024 (tp 8,
dp_shard 128) under PyTorch's fake process group: the same ``parallelize_module`` styles
(TP + SP + loss-parallel head) and the same ``fully_shard`` units. tpplan's side includes
everything ``plan.apply`` does: resolving the patterns and every check. Runs alternate so
both see the same machine state; the median of each is reported.

    python scripts/bench_apply.py [--config 70b] [--world-size 1024] [--tp 8] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import tpplan
from tpplan.models import build_model

PLAN = Path(__file__).resolve().parent.parent / "plans" / "llama.yaml"


def by_hand(model, mesh) -> None:
    """plans/llama.yaml written out as torchtitan-style code."""
    tp_mesh = mesh["tp"]
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
    })
    for block in model.layers:
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                            desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })
        block.attention.n_heads //= tp_mesh.size()
        block.attention.n_kv_heads //= tp_mesh.size()
    dp_mesh = mesh["dp_shard"]
    fully_shard(model.tok_embeddings, mesh=dp_mesh)
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh)
    fully_shard([model.norm, model.output], mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="70b")
    ap.add_argument("--world-size", type=int, default=1024)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()

    plan = tpplan.load(PLAN, [f"model.config={args.config}", f"mesh.tp={args.tp}"])
    dist.init_process_group("fake", rank=0, world_size=args.world_size)
    mesh = plan.parallel_dims(args.world_size).build_mesh("cpu")
    times: dict[str, list[float]] = {"tpplan": [], "by hand": []}
    for _ in range(args.repeat):
        for name in times:
            model = build_model(plan.model, "meta")
            start = time.perf_counter()
            if name == "tpplan":
                plan.apply(model, mesh)
            else:
                by_hand(model, mesh)
            times[name].append(time.perf_counter() - start)
    dist.destroy_process_group()

    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"llama3 {args.config} on meta, world size {args.world_size} "
          f"({plan.parallel_dims(args.world_size)}), median of {args.repeat}:")
    for name, t in med.items():
        print(f"  {name:8s} {t * 1000:8.1f} ms   (runs: "
              + ", ".join(f"{x * 1000:.0f}" for x in times[name]) + ")")
    print(f"  ratio tpplan / by hand: {med['tpplan'] / med['by hand']:.3f}x (target <= 1.3x)")


if __name__ == "__main__":
    main()
