"""Time and peak memory of ``tpplan search`` for the three Llama 3 sizes at the GPU counts
their layouts are usually quoted for (docs/benchmarks.md, "tpplan search").

    PYTHONPATH=. python scripts/bench_search.py [8b 70b 405b]

One process, one search after another; the peak is this process's largest resident set
(``ru_maxrss``), so each size is run in its own child to read its own."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time

CASES = {  # config: (GPUs, sequences per step of 8,192 tokens)
    "8b": (64, 128),
    "70b": (1024, 512),
    "405b": (16384, 2048),
}
COMMON = ["train.seq_len=8192",
          "fsdp.mixed_precision={param_dtype: bfloat16, reduce_dtype: float32}"]


def one(config: str) -> None:
    from tpplan.analysis.search import search
    from tpplan.plan.devices import DEVICES

    gpus, batch = CASES[config]
    start = time.perf_counter()
    data = search("plans/llama.yaml", gpus, DEVICES["h100"],
                  [f"model.config={config}", f"train.global_batch_size={batch}", *COMMON], top=5,
                  progress=lambda m: print(f"[{time.perf_counter() - start:7.1f} s] {m}",
                                           file=sys.stderr, flush=True))
    best = data["ranked"][0] if data["ranked"] else None
    print(json.dumps(dict(
        config=config, gpus=gpus, seconds=round(time.perf_counter() - start, 1),
        max_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
        candidates=data["candidates"], passed_checks=data["passed_checks"],
        fitting=data["fitting"], not_ranked=data["not_ranked"],
        traces=data["traces"], best=best and dict(sets=best["sets"],
                                                  tokens_per_s=round(best["tokens_per_s_per_device"]),
                                                  mfu=round(best["mfu"], 3)))))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        one(sys.argv[2])
    else:
        for config in sys.argv[1:] or list(CASES):
            subprocess.run([sys.executable, __file__, "--one", config], check=True)
