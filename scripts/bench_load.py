"""Peak memory and time of loading HF weights: tpplan on N ranks against transformers on one.

    python scripts/bench_load.py                     # makes a 1b-shape checkpoint first
    python scripts/bench_load.py --folder llama-1b --nproc 4 --tp 2

Each rank builds the model on meta, applies the plan (TP + FSDP2), allocates its shards and
reads only its slices (``model.pretrained``). Memory is sampled from ``/proc/self/status``
every 5 ms: ``RssAnon`` (memory the process owns -- what an out-of-memory kill counts) and
``RssFile`` (pages of the memory-mapped safetensors files: page cache the kernel may drop).
The figure per rank is the peak ``RssAnon`` during the load minus its value just before
the shards were allocated, next to the rank's shard size and the largest single tensor
(fp32); the target is peak <= shard + largest tensor + a fixed overhead.
transformers' ``from_pretrained`` (fp32) is measured the same way in its own process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class Sampler:
    """Peak ``RssAnon``/``RssFile`` (bytes) of this process since ``start``."""

    def __init__(self):
        self.peak_anon = self.peak_file = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def now() -> tuple[int, int]:
        fields = {}
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile"):
                fields[key] = int(value.split()[0]) * 1024
        return fields["RssAnon"], fields["RssFile"]

    def _run(self):
        while not self._stop.is_set():
            anon, file = self.now()
            self.peak_anon, self.peak_file = max(self.peak_anon, anon), max(self.peak_file, file)
            time.sleep(0.005)

    def __enter__(self):
        self.peak_anon, self.peak_file = self.now()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        anon, file = self.now()
        self.peak_anon, self.peak_file = max(self.peak_anon, anon), max(self.peak_file, file)


def _worker(rank, world, port, plan_path, overrides, out):
    import torch.distributed as dist

    from tpplan.parallel.runtime import as_spawned_rank

    as_spawned_rank(rank, world, port)
    import tpplan
    from tpplan.models import build_model, materialize
    from tpplan.train.pretrained import check, load

    plan = tpplan.load(plan_path, overrides)
    model = build_model(plan.model, device="meta", real_buffers=True)
    source = check(plan.model, model)
    largest = max(p.numel() * 4 for p in model.parameters())
    mesh = plan.build_mesh("cpu")
    model = plan.apply(model, mesh)
    dist.barrier()
    before, _ = Sampler.now()
    t0 = time.perf_counter()
    with Sampler() as s:
        materialize(model, "cpu")
        load(source, model)
    seconds = time.perf_counter() - t0
    shard = sum(p.to_local().numel() * p.element_size() if hasattr(p, "to_local")
                else p.numel() * p.element_size() for p in model.parameters())
    dist.barrier()
    Path(out, f"rank{rank}.json").write_text(json.dumps(dict(
        rank=rank, seconds=seconds, anon=s.peak_anon - before, file=s.peak_file,
        shard=shard, largest=largest)))
    dist.destroy_process_group()


def transformers_peak(folder: Path) -> dict:
    code = f"""
import sys, time, json; sys.path.insert(0, {str(ROOT / 'scripts')!r})
from bench_load import Sampler
import torch, transformers
before, _ = Sampler.now(); t0 = time.perf_counter()
with Sampler() as s:
    m = transformers.AutoModelForCausalLM.from_pretrained({str(folder)!r}, dtype=torch.float32)
print(json.dumps(dict(seconds=time.perf_counter() - t0, anon=s.peak_anon - before,
                      file=s.peak_file, model=sum(p.numel() * 4 for p in m.parameters()))))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def gib(n: float) -> str:
    return f"{n / 2 ** 30:.2f} GiB"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--folder", help="an HF Llama folder (default: make a 1b-shape one)")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--plan", default=str(ROOT / "plans" / "hf-llama.yaml"))
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    folder = Path(args.folder) if args.folder else Path(tempfile.mkdtemp()) / "llama-1b"
    if not (folder / "config.json").exists():
        print(f"making a 1b-shape checkpoint (random weights, bf16) in {folder} ...", flush=True)
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_hf.py"), "--size", "1b",
                        "--dtype", "bfloat16", "--no-data", "--out", str(folder)], check=True,
                       capture_output=True)
    files = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    plan = Path(tempfile.mkdtemp()) / "plan.yaml"
    plan.write_text(f"extends: {args.plan}\nmodel: {{hf: null, pretrained: {folder}}}\n")
    from tpplan.parallel.runtime import spawn

    with tempfile.TemporaryDirectory() as out:
        spawn(_worker, args.nproc, str(plan), [f"mesh.tp={args.tp}"], out)
        ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    ref = transformers_peak(folder)
    print(f"checkpoint {folder}: {gib(files)} of safetensors (bf16); model in fp32 "
          f"{gib(ref['model'])}; {args.nproc} ranks, tp {args.tp}")
    print(f"{'':24}{'peak RssAnon':>14}{'shard':>12}{'peak-shard':>12}{'largest':>12}{'time':>9}")
    for r in ranks:
        print(f"{'tpplan rank ' + str(r['rank']):24}{gib(r['anon']):>14}{gib(r['shard']):>12}"
              f"{gib(r['anon'] - r['shard']):>12}{gib(r['largest']):>12}{r['seconds']:>8.1f}s")
    print(f"{'transformers, 1 process':24}{gib(ref['anon']):>14}{gib(ref['model']):>12}"
          f"{'':>12}{'':>12}{ref['seconds']:>8.1f}s")
    worst = max(r["anon"] / ref["anon"] for r in ranks)
    print(f"largest tpplan rank / transformers: {worst:.2f}; peak RssFile (mapped files, "
          f"reclaimable) up to {gib(max(r['file'] for r in ranks))} per rank")
    return 0


if __name__ == "__main__":
    sys.exit(main())
