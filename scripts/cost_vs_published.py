"""tpplan's estimated step time against published measurements (docs/search.md).

Each configuration is a published training run: its model (as a Llama with the same matmul
shapes), GPU count, layout and batch, run through ``tpplan validate``'s dry run and cost
model with the default constants, next to the throughput its authors measured; the step's
non-GEMM kernels traced as `validate --device` traces them, the loss the plain one (every
run below predates tpplan's chunked loss). Usage:

    PYTHONPATH=. python scripts/cost_vs_published.py [--cost compute=0.5,...] [--only NAME]
        [--search]

``--search`` also runs ``tpplan search`` for each row's model, GPUs, batch and sequence
(every layout, checkpointing, micro-batch and schedule left open) and prints the layout it
ranks first beside the one the authors ran, each with tpplan's estimate.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

from tpplan.analysis import ANALYSES  # noqa: E402
from tpplan.analysis.analyses import analyze_kernels  # noqa: E402
from tpplan.analysis.cost.step_time import DEFAULT_CONSTANTS, estimate_step  # noqa: E402
from tpplan.analysis.dryrun import dry_run  # noqa: E402
from tpplan.analysis.cost.schedule import schedule_facts  # noqa: E402
from tpplan.plan.devices import DEVICES  # noqa: E402

# torchtitan's benchmark H100s, as its pages describe them (asyncTP page): "The H100 GPUs used
# for the benchmark were non-standard. They have HBM2e and are limited to a lower TDP. The
# actual peak TFLOPs should be between SXM and NVL, and we don't know the exact value." (the
# 2024-12 page: "96GB HBM2e ... 500W"). The middle of that range (NVL: 835 dense bf16 TFLOP/s;
# SXM: 989.4), not a fit; the rows' ratios at either end are in docs/search.md.
H100_NVL_BF16 = 835e12
TORCHTITAN_H100 = dataclasses.replace(
    DEVICES["h100"], name="h100-500w", memory=96 * 10**9,
    bf16_flops=(H100_NVL_BF16 + DEVICES["h100"].bf16_flops) / 2,
    description="torchtitan's H100 96GB HBM2e at 500 W: peak between NVL and SXM")
DEVICE_OF = {**DEVICES, TORCHTITAN_H100.name: TORCHTITAN_H100}

BF16 = "fsdp.mixed_precision={param_dtype: bfloat16, reduce_dtype: float32}"
FLAT = "mesh.dp_replicate=1"
DDP = "mesh={pp: 16, dp_replicate: 8, dp_shard: 1, tp: 8}"  # replicated weights, as Megatron's DP
# Megatron's DP keeps its weights resident (nothing to gather): FSDP2 at dp_shard 1 would
# otherwise free them after forward and gather and cast them again in backward.
RESIDENT = "fsdp.reshard_after_forward=false"
# GPT-3 175B as a Llama with the same matmuls: 96 heads of 128 (no GQA), an MLP of
# 8h² weights (SwiGLU 3 × h × 8h/3 = GPT's 2 × h × 4h), a 51,200-token vocabulary.
GPT3 = "model={name: llama3, config: 405b, kwargs: {dim: 12288, n_layers: 96, n_heads: 96, " \
       "n_kv_heads: 96, vocab_size: 51200, ffn_hidden: 32768, max_seq_len: 2048}}"


ASYNC_TP = "torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (bf16, vanilla TP)"


def llama(size: str) -> str:
    return f"model={{name: llama3, config: {size}, kwargs: {{max_seq_len: 8192}}}}"


def pipe(schedule: str, m: int, v: int = 1) -> str:
    extra = f", stages_per_rank: {v}" if v > 1 else ""
    return f"pipeline={{schedule: {schedule}, microbatches: {m}{extra}}}"


# name, source, device, world, --set lines, measured: ("tps", tokens/s per GPU) |
# ("tflops", model TFLOP/s per GPU, converted with tpplan's FLOP count) | ("seconds", step)
CONFIGS = [
    ("torchtitan 8B, 8 GPUs", "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1 (FSDP, no compile)",
     "h100-500w", 8, [llama("8b"), FLAT, "mesh.tp=1", BF16, "train.seq_len=8192",
                 "train.global_batch_size=16", "activation_checkpointing={mode: selective, every: 2}"],
     ("tps", 5762)),
    ("torchtitan 8B, 128 GPUs", "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 3 (FSDP, no compile)",
     "h100-500w", 128, [llama("8b"), FLAT, "mesh.tp=1", BF16, "train.seq_len=8192",
                   "train.global_batch_size=256", "activation_checkpointing={mode: selective, every: 2}"],
     ("tps", 5605)),
    ("torchtitan 8B, 64 GPUs, TP 8", ASYNC_TP,
     "h100-500w", 64, [llama("8b"), FLAT, "mesh.tp=8", BF16, "train.seq_len=8192",
                  "train.global_batch_size=96", "activation_checkpointing={mode: selective, every: 2}"],
     ("tps", 4378)),
    ("torchtitan 70B, 256 GPUs, TP 8", ASYNC_TP,
     "h100-500w", 256, [llama("70b"), FLAT, "mesh.tp=8", BF16, "train.seq_len=8192",
                   "train.global_batch_size=512", "activation_checkpointing={mode: full}"],
     ("tps", 597.3)),
    ("Megatron-LM GPT-3 175B, 1024 A100", "Megatron-LM README (2022), 'GPT-3 Example'; examples/pretrain_gpt3_175B.sh",
     "a100-80gb", 1024, [GPT3, DDP, RESIDENT, "mesh.tp=8", "mesh.pp=16", BF16, "train.seq_len=2048",
                         "train.global_batch_size=1536", "train.micro_batch_size=1",
                         "activation_checkpointing={mode: full}", pipe("1f1b", 192)],
     ("seconds", 32.0)),
    # The paper's v: "we reduce one Transformer layer each from the first and the last stages
    # ... the first model chunk on the first stage has only the embedding": one layer a chunk,
    # 126 + 2 = 128 chunks on 16 ranks, v = 8. tpplan's split gives every stage a block, so
    # 126 blocks take at most v = 7; v = 4 puts the same 8 blocks on the busiest rank as the
    # paper's v = 8 (7 on the ends), and SOURCE_V's bubble is printed beside it.
    *[(f"Llama 3 405B, {gpus:,} H100 (v=4)", "Llama 3 paper Table 4 (as transcribed from Balaji, SC'24)",
       "h100", gpus, [llama("405b"), FLAT, "mesh.tp=8", "mesh.pp=16", BF16, "train.seq_len=8192",
                      "train.global_batch_size=2048", "train.micro_batch_size=1",
                      "fsdp.reshard_after_forward=false", pipe("interleaved_1f1b", m, 4)],
       ("tflops", tflops))
      for gpus, m, tflops in ((8192, 32, 430), (16384, 16, 400))],
]
SOURCE_V = {"Llama 3 405B": 8}  # the v the source implies, where tpplan lays out another

# Narayanan et al. 2021 (arXiv 2104.04473), Table 1, weak scaling on A100s: GPT models of
# vocabulary 51,200 and sequence 2,048, fp16, activation recomputation, Megatron's replicated
# data parallelism. (params B, layers, hidden, heads, tp, pp, GPUs, batch, TFLOP/s per GPU.)
WEAK_SCALING = [(1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 30, 3072, 32, 2, 1, 64, 512, 138),
                (7.5, 36, 4096, 32, 4, 1, 128, 512, 142), (18.4, 40, 6144, 48, 8, 1, 256, 1024, 135),
                (39.1, 48, 8192, 64, 8, 2, 512, 1536, 138), (76.1, 60, 10240, 80, 8, 4, 1024, 1792, 140),
                (145.6, 80, 12288, 96, 8, 8, 1536, 2304, 148), (310.1, 96, 16384, 128, 8, 16, 1920, 2160, 155),
                (529.6, 105, 20480, 128, 8, 35, 2520, 2520, 163), (1008.0, 128, 25600, 160, 8, 64, 3072, 3072, 163)]
WEAK_SOURCE = "Narayanan et al. 2021, 'Efficient Large-Scale Language Model Training ...', Table 1"


def megatron_step(batch: int, layers: int, hidden: int, tflops: float, gpus: int, seq: int = 2048,
                  vocab: int = 51200) -> float:
    """The paper's step time: its own FLOP count (eq. 3, ``96·B·s·l·h²·(1 + s/6h + V/16lh)``, which
    counts the recomputed forward) over its achieved TFLOP/s per GPU times the GPUs."""
    flops = 96 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
    return flops / (tflops * 1e12 * gpus)


def weak_scaling_row(params, layers, hidden, heads, tp, pp, gpus, batch, tflops) -> tuple:
    """A Table 1 row as a Llama with GPT's matmuls: SwiGLU width 8h/3 (to a multiple of 64,
    within 0.2% of GPT's 8h² MLP), no GQA; micro-batch 1 and 1F1B, as Megatron's GPT-3 example."""
    dp = gpus // (tp * pp)
    model = (f"model={{name: llama3, config: 405b, kwargs: {{dim: {hidden}, n_layers: {layers}, n_heads: {heads}, "
             f"n_kv_heads: {heads}, vocab_size: 51200, ffn_hidden: {64 * round(8 * hidden / 3 / 64)}, "
             "max_seq_len: 2048}}")
    sets = [model, f"mesh={{pp: {pp}, dp_replicate: {dp}, dp_shard: 1, tp: {tp}}}", RESIDENT, BF16,
            "train.seq_len=2048", f"train.global_batch_size={batch}", "train.micro_batch_size=1",
            "activation_checkpointing={mode: full}"]
    if pp > 1:
        sets.append(pipe("1f1b", batch // dp))
    return (f"Megatron weak scaling {params:g}B, {gpus:,} A100", WEAK_SOURCE, "a100-80gb", gpus, sets,
            ("seconds", megatron_step(batch, layers, hidden, tflops, gpus)))


CONFIGS += [weak_scaling_row(*row) for row in WEAK_SCALING]


def measured_seconds(kind: str, value: float, est, world: int) -> float:
    if kind == "seconds":
        return value
    if kind == "tps":
        return est.tokens_per_step / (value * world)
    flops = est.details["model_flops_per_step"]
    return flops / (value * 1e12 * world)


def with_bubble_of(result, est, v: int, measured: float) -> dict:
    """``est`` with its bubble term recomputed for ``v`` stages per rank (the cost model's
    own ``bubble_fraction × (compute + recompute + non_gemm + tp)``, the fraction simulated
    from torch's schedule at that v); every other term as laid out."""
    pipe = result.plan.spec.pipeline
    fraction, _ = schedule_facts(pipe.schedule, result.resolution.dims.pp, v, pipe.microbatches)
    t = est.terms
    step = est.step_time - t["bubble"] + fraction * (t["compute"] + t["recompute"] + t.get("non_gemm", 0.0)
                                                     + t["tp"])
    return dict(bubble_fraction=fraction, step=step, ratio=step / measured)


LAYOUT = ("mesh", "activation_checkpointing", "train.micro_batch_size", "pipeline")


def searched(plan: str, device, world: int, sets: list[str], constants) -> dict:
    """``search``'s first layout for the row's plan with its layout settings left open."""
    from tpplan.analysis.search.ranking import search

    t0 = time.perf_counter()
    data = search(plan, world, device, [s for s in sets if not s.startswith(LAYOUT)],
                  top=1, constants=constants)
    best = data["ranked"][0]
    return dict(sets=best["sets"], step=best["step_time"], mfu=best["mfu"],
                tokens_per_s_per_device=best["tokens_per_s_per_device"],
                candidates=data["candidates"], seconds=time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--plan", default="plans/llama.yaml")
    ap.add_argument("--cost", default="")
    ap.add_argument("--only", default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--search", action="store_true",
                    help="also rank every layout for the row's model, GPUs and batch")
    args = ap.parse_args()
    constants = DEFAULT_CONSTANTS.with_values(args.cost)
    rows = []
    for name, source, dev, world, sets, (kind, value) in CONFIGS:
        if args.only and args.only not in name:
            continue
        t0 = time.perf_counter()
        r = dry_run(args.plan, world, [*sets, "train.loss_chunk=0"], ANALYSES + [("kernels", analyze_kernels)])
        if not r.ok:
            why = r.errors[0].message if r.errors else r.analysis_errors[0].message
            print(f"{name}: dry run failed: {why}", file=sys.stderr)
            continue
        est = estimate_step(r, DEVICE_OF[dev], 8, constants)
        r.extra.pop("kernels", None)  # priced into est (details.non_gemm)
        measured = measured_seconds(kind, value, est, world)
        rows.append(dict(name=name, source=source, world=world, mesh=r.resolution.dims.as_dict(),
                         measured_step=measured, estimated_step=est.step_time,
                         ratio=est.step_time / measured, dominant=est.dominant,
                         measured_tps=est.tokens_per_step / measured / world,
                         estimated_tps=est.tokens_per_s_per_device, mfu=est.mfu,
                         terms=est.terms, seconds=time.perf_counter() - t0))
        source_v = next((v for k, v in SOURCE_V.items() if name.startswith(k)), None)
        if source_v:  # the same estimate with the bubble of the source's v
            rows[-1]["source_v"] = dict(v=source_v, **with_bubble_of(r, est, source_v, measured))
        print(f"{name}: measured {measured:.3f} s, estimated {est.step_time:.3f} s, "
              f"ratio {est.step_time / measured:.3f}, "
              + ", ".join(f"{k} {v:.3f}" for k, v in est.terms.items() if v)
              + (f"; with v={source_v}'s bubble {rows[-1]['source_v']['step']:.3f} s, ratio "
                 f"{rows[-1]['source_v']['ratio']:.3f}" if source_v else "")
              + f" ({rows[-1]['seconds']:.0f} s)", file=sys.stderr)
        if args.search:
            rows[-1]["search"] = searched(args.plan, DEVICE_OF[dev], world, sets, constants)
            first = rows[-1]["search"]
            print(f"  search ranks first: {' '.join(first['sets'])}: {first['step']:.3f} s "
                  f"({first['step'] / est.step_time:.2f} of the authors' layout's estimate; "
                  f"search took {first['seconds']:.0f} s)", file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
