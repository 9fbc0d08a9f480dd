"""Time and peak memory of ``tpplan search`` for the three Llama 3 sizes at the GPU counts
their layouts are usually quoted for, and for a space with expert and context parallelism
in it (docs/benchmarks.md, "tpplan search").

    PYTHONPATH=. python scripts/bench_search.py [8b 70b 70b-fp32 405b moe long]

One process, one search after another; the peak is this process's largest resident set
(``ru_maxrss``), so each case is run in its own child to read its own. Each case prints one
JSON line with its time, its counts and the layout ranked first."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time

BF16 = "fsdp.mixed_precision={param_dtype: bfloat16, reduce_dtype: float32}"
CASES = {  # name: (plan, GPUs, --set lines); every case runs on H100s, --top 5
    # Llama 3 at 8,192 tokens a sequence, bf16 mixed precision.
    "8b": ("plans/llama.yaml", 64, ["model.config=8b", "train.seq_len=8192",
                                    "train.global_batch_size=128", BF16]),
    "70b": ("plans/llama.yaml", 1024, ["model.config=70b", "train.seq_len=8192",
                                       "train.global_batch_size=512", BF16]),
    # The plan as shipped: fp32 (no mixed precision), the measured command.
    "70b-fp32": ("plans/llama.yaml", 1024, ["model.config=70b", "train.seq_len=8192",
                                            "train.global_batch_size=512"]),
    "405b": ("plans/llama.yaml", 16384, ["model.config=405b", "train.seq_len=8192",
                                         "train.global_batch_size=2048", BF16]),
    # The tiny Qwen3-MoE (8 experts, top-2; 30B-A3B's dry run at full size is dominated by
    # transformers' eager experts loop on fake tensors, docs/moe.md): ep in the space.
    "moe": ("plans/qwen3-moe-ep-tiny.yaml", 64, ["train.seq_len=4096",
                                                "train.global_batch_size=256"]),
    # Llama 3 8B at 131,072 tokens a sequence: cp in the space (every cp of the world).
    "long": ("plans/llama-long.yaml", 64, [
        "model={name: llama3, config: 8b, kwargs: {max_seq_len: 131072}}",
        "train.seq_len=131072", "train.global_batch_size=16", BF16]),
}


def one(name: str) -> None:
    from tpplan.analysis.search.ranking import search
    from tpplan.plan.devices import DEVICES

    plan, gpus, sets = CASES[name]
    start = time.perf_counter()
    data = search(plan, gpus, DEVICES["h100"], sets, top=5,
                  progress=lambda m: print(f"[{time.perf_counter() - start:7.1f} s] {m}",
                                           file=sys.stderr, flush=True))
    best = data["ranked"][0] if data["ranked"] else None
    print(json.dumps(dict(
        case=name, plan=plan, gpus=gpus, seconds=round(time.perf_counter() - start, 1),
        max_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
        candidates=data["candidates"], passed_checks=data["passed_checks"],
        fitting=data["fitting"], not_ranked=data["not_ranked"],
        traces=data["traces"], best=best and dict(sets=best["sets"],
                                                  tokens_per_s=round(best["tokens_per_s_per_device"]),
                                                  mfu=round(best["mfu"], 3)))), flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        one(sys.argv[2])
    else:
        for name in sys.argv[1:] or list(CASES):
            subprocess.run([sys.executable, __file__, "--one", name], check=True)
