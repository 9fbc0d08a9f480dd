"""The EP row of ``scripts/bench_train.py``: tpplan's expert-parallel MoE layer against the
same all-to-all dispatch written by hand with ``torch.distributed``, and the bytes each rank
sends against the minimum.

One transformers ``Qwen3MoeSparseMoeBlock`` (hidden 256, 16 experts of 256, top-4; its
default ``grouped_mm`` experts) on 4 gloo ranks at ep 4, each rank routing its own tokens:

- ``tpplan``: ``parallelize_module(block.experts, ep_mesh, ExpertParallel())``, the style the
  plans' ``expert_parallel`` rule applies (DTensor ``Shard(0)`` parameters, counts exchanged,
  variable-size ``all_to_all_single_autograd`` there and back, the module's own forward on
  the local experts);
- ``hand``: the experts' parameters sliced to the rank's ``E/ep`` by hand (plain tensors) and
  the same dispatch spelled out: ``bincount``, ``all_to_all_single`` of the counts, sort,
  ``all_to_all_single_autograd`` of the rows, the local experts, the reverse all-to-all,
  weights and ``index_add``.

A step is forward and backward of the block on the rank's tokens; rounds alternate the two
sides (which goes first alternates too), medians are printed with their ratio. Bytes: what
rank 0's dispatch sends to other ranks (one row per (token, expert) pair) against the minimum
(each token's hidden state once to each distinct remote rank among its top-k), counted from
the routing of that step.

    OMP_NUM_THREADS=1 python scripts/bench_ep.py [--steps 10] [--rounds 4] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
EP, EXPERTS, TOP_K, HIDDEN = 4, 16, 4, 256


def _block():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=256, num_experts=EXPERTS,
                            num_experts_per_tok=TOP_K, norm_topk_prob=True)
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    return block


def _hand(block, group, rank: int):
    """The experts sliced to this rank's by hand, the dispatch spelled out."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    experts = block.experts
    local = EXPERTS // EP
    for name, p in list(experts.named_parameters(recurse=False)):
        experts.register_parameter(name, torch.nn.Parameter(p.detach()[rank * local:][:local].clone()))
    forward = experts.forward
    experts.num_experts = local

    def dispatch(hidden, ids, weights):
        k = ids.shape[-1]
        counts = torch.bincount(ids.reshape(-1), minlength=EXPERTS)
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts, group=group)
        order = torch.argsort(ids.reshape(-1), stable=True)
        token = order // k
        send = counts.view(EP, local).sum(1).tolist()
        recv = got.view(EP, local).sum(1).tolist()
        rows = all_to_all_single_autograd(hidden[token], recv, send, group)
        mine = torch.repeat_interleave(torch.arange(local).repeat(EP), got)
        out = forward(rows, mine[:, None], torch.ones(len(mine), 1, dtype=rows.dtype))
        back = all_to_all_single_autograd(out, send, recv, group)
        return torch.zeros_like(hidden).index_add(0, token, back * weights.reshape(-1)[order, None])

    experts.forward = dispatch
    return block


def _tpplan(block, mesh):
    from torch.distributed.tensor.parallel import parallelize_module

    from tpplan.parallel.experts.style import ExpertParallel

    parallelize_module(block.experts, mesh, ExpertParallel())
    return block


def _steps(block, x: torch.Tensor, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        block(x).float().square().mean().backward()
        times.append(time.perf_counter() - start)
        block.zero_grad(set_to_none=True)
    return times


def sent_bytes(ids: torch.Tensor, rank: int) -> tuple[int, int]:
    """Rows rank ``rank``'s dispatch sends to other ranks, and the minimum's rows (each token
    once per distinct remote rank among its experts)."""
    owner = ids // (EXPERTS // EP)
    pairs = int((owner != rank).sum())
    distinct = sum(len(set(row) - {rank}) for row in owner.tolist())
    return pairs, distinct


def ep_row(rank: int, steps: int, rounds: int, tokens: int) -> None:
    """Run the row on this rank (the process group up, 4 ranks); rank 0 prints it."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (EP,), mesh_dim_names=("ep",))
    group = mesh.get_group()
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(1, tokens, HIDDEN, generator=gen)
    sides = {"hand": _hand(_block(), group, rank), "tpplan": _tpplan(_block(), mesh)}
    times: dict[str, list[float]] = {"hand": [], "tpplan": []}
    skip = 2
    for r in range(rounds):
        for side in ("hand", "tpplan") if r % 2 == 0 else ("tpplan", "hand"):
            times[side] += _steps(sides[side], x, steps)[skip:]
    with torch.no_grad():
        _, _, ids = sides["hand"].gate(x.reshape(-1, HIDDEN))
    pairs, distinct = sent_bytes(ids, rank)
    if rank == 0:
        h, t = statistics.median(times["hand"]), statistics.median(times["tpplan"])
        row = HIDDEN * 4
        print(f"\n[ep] hand-written dispatch: median step {h * 1e3:.1f} ms over "
              f"{len(times['hand'])} steps")
        print(f"[ep] tpplan expert_parallel: median step {t * 1e3:.1f} ms over "
              f"{len(times['tpplan'])} steps")
        print(f"[ep] ratio tpplan / hand-written: {t / h:.3f}x")
        print(f"[ep] rank 0 dispatch sends {pairs * row / 2**20:.2f} MiB to other ranks "
              f"({pairs} rows, one per (token, expert) pair); the minimum is "
              f"{distinct * row / 2**20:.2f} MiB ({distinct} rows, each token once per distinct "
              f"remote rank): {pairs / distinct:.2f}x", flush=True)


def _worker(rank: int, world: int, port: int, args) -> None:
    from tpplan.parallel.runtime import as_spawned_rank

    as_spawned_rank(rank, world, port)
    dist.init_process_group("gloo")
    try:
        ep_row(rank, args.steps, args.rounds, args.tokens)
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--tokens", type=int, default=2048, help="tokens each rank routes")
    args = p.parse_args()
    from tpplan.parallel.runtime import spawn

    spawn(_worker, EP, args)


if __name__ == "__main__":
    main()
