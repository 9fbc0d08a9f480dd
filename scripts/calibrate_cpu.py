"""Calibration on this machine: the cost model's compute efficiency fitted to a real
``tpplan train`` run on gloo CPU processes, then used to predict another layout.

1. The "device": one CPU core (OMP_NUM_THREADS=1, one per rank) -- its fp32 matmul peak
   measured on a large square matmul (the training computes in fp32 on CPU), and gloo's
   all-reduce between two local processes, measured, as the "intra-node" link: its
   bandwidth on a 16 MiB buffer, its latency (α per ring step) on a 4-byte one.
2. ``tpplan train`` on 2 processes with layout A (tp 1, dp_shard 2), then layout B (tp 2).
3. ``calibrate`` on A's metrics.jsonl; the fitted model's step time for A against A's
   measured median step (this is the fit: it must agree), and for B (a prediction).

    PYTHONPATH=. python scripts/calibrate_cpu.py [--steps 12] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402

from tpplan.analysis.cost.calibration import fit_report, measured_step  # noqa: E402
from tpplan.analysis.cost.step_time import DEFAULT_CONSTANTS  # noqa: E402
from tpplan.plan.devices import GiB, Device  # noqa: E402

SIZE = ["model.kwargs={n_layers: 4, dim: 256, n_heads: 8, n_kv_heads: 4}", "train.seq_len=128",
        "train.global_batch_size=8", "train.warmup_steps=2", "data.max_bytes=400000",
        "checkpoint.enabled=false", "metrics.log_interval=1"]
LAYOUTS = {"A (tp 1, dp_shard 2)": ["mesh.tp=1"], "B (tp 2, dp_shard 1)": ["mesh.tp=2"]}


def matmul_peak(n: int = 1024, reps: int = 10) -> float:
    torch.set_num_threads(1)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n ** 3 * reps / (time.perf_counter() - t0)


def _allreduce(rank, world, port, out, nbytes):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    x = torch.zeros(nbytes // 4)
    dist.all_reduce(x)
    t0 = time.perf_counter()
    for _ in range(5):
        dist.all_reduce(x)
    dt = (time.perf_counter() - t0) / 5
    tiny = torch.zeros(1)
    for _ in range(10):
        dist.all_reduce(tiny)
    t0 = time.perf_counter()
    for _ in range(200):
        dist.all_reduce(tiny)
    alpha = (time.perf_counter() - t0) / 200 / (2 * (world - 1))  # a ring's 2(n-1) steps
    if rank == 0:  # ring wire bytes one rank sends: 2(n-1)/n of the buffer
        Path(out).write_text(json.dumps([2 * (world - 1) / world * nbytes / dt, alpha]))
    dist.destroy_process_group()


def gloo_link(nbytes: int = 16 * 2 ** 20) -> tuple[float, float]:
    """gloo's all-reduce bandwidth (bytes/s one rank sends) and latency per ring step."""
    from tpplan.parallel.runtime import spawn

    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "bw")
        spawn(_allreduce, 2, out, nbytes)
        bw, alpha = json.loads(Path(out).read_text())
        return bw, alpha


def train(run_dir: Path, sets: list[str], steps: int) -> Path:
    cmd = [sys.executable, "-m", "tpplan", "train", "--plan", "plans/llama.yaml", "--nproc", "2"]
    for s in [*SIZE, f"train.steps={steps}", f"metrics.run_dir={run_dir}", *sets]:
        cmd += ["--set", s]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return run_dir / "metrics.jsonl"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    peak, (bw, alpha) = matmul_peak(), gloo_link()
    # NVLink's figure counts both directions; the model halves it, so give gloo's twice.
    # The measured α replaces NCCL's (the whole call's time is steps × α: no separate base).
    cpu = Device("cpu-core", 8 * GiB, bf16_flops=peak, intra_node_bandwidth=2 * bw,
                 inter_node_bandwidth=bw, description="one CPU core, fp32 matmul, gloo",
                 collective_latency=0.0, intra_node_latency=alpha, inter_node_latency=alpha)
    base = Path(args.out or tempfile.mkdtemp(prefix="calib-"))
    metrics = {name: train(base / name.split()[0], sets, args.steps)
               for name, sets in LAYOUTS.items()}
    names = list(metrics)
    c = DEFAULT_CONSTANTS.with_values("intra_node=1,inter_node=1")
    fitted, fit_rows = fit_report([metrics[names[0]]], None, [], cpu, 2, c)
    measured_b = measured_step(metrics[names[1]])["step_time"]
    from tpplan.analysis import ANALYSES
    from tpplan.analysis.cost.step_time import estimate_step
    from tpplan.analysis.dryrun import dry_run

    r = dry_run(str(metrics[names[1]].parent / "plan.yaml"), 2, [], ANALYSES)
    predicted_b = estimate_step(r, cpu, 2, fitted)
    report = dict(peak_flops=peak, gloo_bandwidth=bw, gloo_latency_per_step=alpha,
                  fitted=fitted.to_json(),
                  fit={names[0]: fit_rows[0]},
                  prediction={names[1]: dict(measured=measured_b,
                                             predicted=predicted_b.step_time,
                                             ratio=predicted_b.step_time / measured_b,
                                             terms=predicted_b.terms)})
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
