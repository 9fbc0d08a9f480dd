"""What a rank pays for its data, and whether the loader keeps up (docs/benchmarks.md).

    python scripts/bench_data.py [--dir /tmp/tpplan-bench-data] [--sizes 0.1,1,8] [--steps 300]

1. **Resident memory per rank against corpus size.** Flat uint16 token files of 100 MB, 1 GB
   and 8 GB (random ids in the first 64 MB, the rest a sparse hole: written in a second,
   read like any other file) are each opened by 2 rank processes (dp = 2) exactly as
   ``tpplan train`` opens them (:func:`tpplan.train.corpora.open_feed`: the dtype and size
   checks, the largest-id scan, the memory maps) and read for ``--steps`` steps of the
   debug Llama's global batch (16 × 128) at random windows spread over the whole file. Each
   rank's peak resident set (``VmHWM``) is reported; it must grow by at most 50 MB from the
   smallest corpus to the largest.
2. **Loader tokens/s against the step.** The same ranks' tokens gathered per second (with
   the background thread gathering ahead, as in training), against the tokens per second
   the debug Llama's training step consumes on this machine (``tpplan train --nproc 2`` on
   the 100 MB corpus, the median step after the first): the loader must deliver >= 20×.
3. **``tpplan data prepare`` throughput** on 1 and 2 workers: standard-library sources
   tokenized by the tiny Llama's BPE tokenizer (scripts/make_tiny_hf.py).

The corpora are deleted at the end (``--keep`` keeps them).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
BATCH, SEQ = 16, 128  # plans/llama.yaml's global batch and sequence
DENSE = 64 << 20  # bytes of random ids at the head of each corpus


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    return f"{cpu}, {os.cpu_count()} cores, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"


def make_corpus(path: Path, size: int) -> None:
    rng = np.random.default_rng(0)
    rng.integers(0, 256, min(size, DENSE) // 2, dtype=np.uint16).tofile(path)
    with open(path, "r+b") as f:
        f.truncate(size)  # the rest a hole: zeros, read like any other page


def peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def rank(path: str, rank_: int, steps: int, cache: str, out: mp.Queue) -> None:
    os.environ["TPPLAN_CACHE"] = cache
    from tpplan.plan.specs import DataSpec, EvalSpec
    from tpplan.train.corpora import open_feed

    before = peak_rss_mb()
    feed = open_feed(DataSpec(path=path, dtype="uint16"), EvalSpec(), 0, BATCH, SEQ, 256)
    stride = max(feed.windows[0] // steps, 1) * BATCH  # steps spread over the whole file
    feed.batch(1, rank_, 2)  # the thread started
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        feed.batch(1 + (step * stride) // BATCH, rank_, 2)
    dt = time.perf_counter() - t0
    feed.close()
    out.put({"rank": rank_, "peak_mb": peak_rss_mb(), "imports_mb": before,
             "tokens_per_s": steps * (BATCH // 2) * (SEQ + 1) / dt})


def loader(path: Path, steps: int, cache: Path) -> list[dict]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=rank, args=(str(path), r, steps, str(cache), q)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted((q.get() for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join()
    return got


def train_tokens_per_s(path: Path, run_dir: Path) -> float:
    cmd = [sys.executable, "-m", "tpplan", "train", "--plan", str(ROOT / "plans" / "llama.yaml"),
           "--nproc", "2", "--overwrite", "--set", "mesh.tp=1", "--set", "train.steps=8",
           "--set", f"data.path={path}", "--set", "data.dtype=uint16",
           "--set", "checkpoint.enabled=false", "--set", f"metrics.run_dir={run_dir}"]
    subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["tokens_per_s"] for r in rows[1:])


def prepare_rate(texts: Path, tokenizer: Path, out: Path, workers: int) -> tuple[float, int, int, float]:
    """(wall seconds, documents, tokens, CPU seconds of this process and its workers)."""
    import resource

    from tpplan.data.prepare import PrepareJob, prepare

    def cpu() -> float:
        return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                     resource.getrusage(resource.RUSAGE_CHILDREN)))

    shutil.rmtree(out, ignore_errors=True)
    before = cpu()
    done = prepare(PrepareJob(str(texts), str(out), str(tokenizer), docs_per_shard=100), workers)
    return done.seconds, done.manifest["documents"], done.manifest["tokens"], cpu() - before


def prepare_rates(work: Path, files: int, rounds: int) -> None:
    """``data prepare`` of ``files`` stdlib sources on 1 and 2 workers, alternated ``rounds``
    times, each figure with the load average and the CPU seconds it took (a shared machine
    gives a second worker a core only when one is idle)."""
    texts = work / "texts"
    texts.mkdir(exist_ok=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for i, f in enumerate(sorted(stdlib.rglob("*.py"))[:files]):
        shutil.copy(f, texts / f"{i:05d}.py")
    tok = work / "tiny-llama"
    if not (tok / "tokenizer.json").exists():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_hf.py"), "--family", "llama",
                        "--no-data", "--out", str(tok)], check=True, capture_output=True)
    mb = sum(f.stat().st_size for f in texts.iterdir()) / 1e6
    for _ in range(rounds):
        for workers in (1, 2):
            seconds, docs, tokens, cpu = prepare_rate(texts, tok, work / f"store-{workers}", workers)
            load = " ".join(f"{x:.2f}" for x in os.getloadavg())
            print(f"data prepare, {workers} worker(s): {docs:,} files ({mb:.1f} MB), {tokens:,} tokens in "
                  f"{seconds:.1f} s = {tokens / seconds:,.0f} tokens/s; {cpu:.1f} CPU s; load average {load}",
                  flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/tpplan-bench-data")
    ap.add_argument("--sizes", default="0.1,1,8", help="corpus sizes in GB")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--prepare-files", type=int, default=1500, help="stdlib files tokenized")
    ap.add_argument("--rounds", type=int, default=1, help="1 and 2 workers alternated this many times")
    ap.add_argument("--only-prepare", action="store_true", help="only the data prepare figures")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    work = Path(args.dir)
    work.mkdir(parents=True, exist_ok=True)
    print(f"machine: {machine()}")
    try:
        if args.only_prepare:
            prepare_rates(work, args.prepare_files, args.rounds)
            return
        rows = []
        for gb in (float(x) for x in args.sizes.split(",")):
            path = work / f"corpus-{gb:g}GB.bin"
            make_corpus(path, int(gb * 1e9) // 2 * 2)
            got = loader(path, args.steps, work / "cache")
            rows.append((gb, got))
            peaks = ", ".join(f"{r['peak_mb']:.1f}" for r in got)
            print(f"{gb:>5g} GB: peak RSS per rank {peaks} MB "
                  f"(after imports {got[0]['imports_mb']:.1f}); loader {sum(r['tokens_per_s'] for r in got):,.0f} "
                  f"tokens/s over 2 ranks", flush=True)
        growth = max(r["peak_mb"] for r in rows[-1][1]) - max(r["peak_mb"] for r in rows[0][1])
        print(f"growth of the peak from {rows[0][0]:g} GB to {rows[-1][0]:g} GB: {growth:+.1f} MB "
              f"({'within' if growth <= 50 else 'OVER'} the 50 MB bound)")
        step_rate = train_tokens_per_s(work / f"corpus-{rows[0][0]:g}GB.bin", work / "run")
        load_rate = min(sum(r["tokens_per_s"] for r in got) for _, got in rows)
        print(f"debug Llama training step (2 ranks): {step_rate:,.0f} tokens/s; the loader's slowest "
              f"{load_rate:,.0f} tokens/s = {load_rate / step_rate:,.0f}× what the step consumes")
        prepare_rates(work, args.prepare_files, args.rounds)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
