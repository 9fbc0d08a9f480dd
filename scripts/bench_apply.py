"""How much does the plan cost? ``plan.apply`` against the same torch calls written by hand.

Both sides parallelize the 70b Llama on the meta device at world size 1024 (tp 8,
dp_shard 128) under PyTorch's fake process group: the same ``parallelize_module`` styles
(TP + SP + loss-parallel head) and the same ``fully_shard`` units. tpplan's side includes
everything ``plan.apply`` does: resolving the patterns and every check. Runs alternate so
both see the same machine state; the median of each is reported.

    python scripts/bench_apply.py [--config 70b] [--world-size 1024] [--tp 8] [--repeat 5]
    python scripts/bench_apply.py --baseline /path/to/other/checkout [--rounds 4]

``--baseline`` compares two versions of tpplan side by side: each round runs this tree's
copy of the script and the other checkout's (alternating which goes first), each against
its own hand-written twin, and reports both ratios and this tree's time over the other's.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
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
from checkout import command
from tpplan.models import build_model

ROOT = Path(__file__).resolve().parent.parent
PLAN = ROOT / "plans" / "llama.yaml"


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


def compare(baseline: Path, rounds: int, argv: list[str]) -> None:
    """This tree against ``baseline``: medians over ``rounds`` alternating runs."""
    runs: dict[str, list[tuple[float, float]]] = {"this tree": [], "baseline": []}
    trees = [("this tree", ROOT), ("baseline", baseline)]
    for r in range(rounds):
        for name, root in trees if r % 2 == 0 else trees[::-1]:
            out = subprocess.run(command(root, root / "scripts" / "bench_apply.py", *argv),
                                 check=True, capture_output=True, text=True).stdout
            ms = [float(re.search(rf"{k}\s+([\d.]+) ms", out).group(1)) for k in ("tpplan", "by hand")]
            runs[name].append((ms[0], ms[1]))
    med = {name: (statistics.median(t for t, _ in v), statistics.median(h for _, h in v),
                  statistics.median(t / h for t, h in v)) for name, v in runs.items()}
    print(f"baseline: {baseline}; {rounds} alternating rounds, medians")
    for name, (t, h, ratio) in med.items():
        print(f"  {name:10s} tpplan {t:7.1f} ms   by hand {h:7.1f} ms   ratio {ratio:.3f}x")
    print(f"  this tree / baseline (plan.apply): {med['this tree'][0] / med['baseline'][0]:.3f}x; "
          f"(ratio to by hand): {med['this tree'][2] / med['baseline'][2]:.3f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="70b")
    ap.add_argument("--world-size", type=int, default=1024)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--baseline", type=Path, help="another checkout of tpplan to compare with")
    ap.add_argument("--rounds", type=int, default=4, help="alternating rounds with --baseline")
    args = ap.parse_args()
    if args.baseline:
        compare(args.baseline, args.rounds, [f"--config={args.config}", f"--tp={args.tp}",
                                             f"--world-size={args.world_size}",
                                             f"--repeat={args.repeat}"])
        return

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
