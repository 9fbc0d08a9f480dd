"""Measure bf16 GEMM rates on this GPU at the shapes a rank of the Llama 3 models runs, and
set each beside the cost model's shape efficiency (``tpplan.analysis.cost.gemm``), which was
taken from NVIDIA's tile and wave quantization rules and the roofline, not fitted to this.

    PYTHONPATH=. python scripts/gemm_shapes.py [--preset h100|h200] [--json]

For each shape ``M × N × K`` (output ``M × N``): the measured TFLOP/s (median of timed
runs after warm-ups, CUDA events), the measured fraction of the large square GEMM's rate
(8192³), and the model's ``f`` for the same shape on the preset. The large GEMM's rate over
the preset's bf16 peak is the preset's ``gemm_fraction`` (MAMF). Needs a CUDA GPU."""

from __future__ import annotations

import argparse
import json
import statistics
import sys

# (label, M, N, K): a Linear's forward Y = X Wᵀ is tokens × out × in, dX is tokens × in ×
# out, dW is out × in × tokens (tpplan.analysis.cost.gemm.linear_efficiencies).
MODELS = {  # name: width, feed-forward width, KV width (8 KV heads of 128)
    "8b": (4096, 14336, 1024),
    "70b": (8192, 28672, 1024),
}


def shapes() -> list[tuple[str, int, int, int]]:
    out = [("square 8192", 8192, 8192, 8192), ("square 4096", 4096, 4096, 4096),
           ("square 2048", 2048, 2048, 2048), ("square 1024", 1024, 1024, 1024),
           ("debug width 256, 4096 tokens", 4096, 256, 256),
           ("debug width 256, 512 tokens", 512, 256, 256)]
    for name, (d, ffn, kv) in MODELS.items():
        for tp in (1, 2, 8):
            for tokens in (2048, 8192):
                for part, i, o in (("q", d, d // tp), ("kv", d, max(kv // tp, 128)),
                                   ("up", d, ffn // tp), ("down", ffn // tp, d)):
                    out.append((f"{name} tp{tp} {part} fwd, {tokens} tokens", tokens, o, i))
                    out.append((f"{name} tp{tp} {part} dW, {tokens} tokens", o, i, tokens))
    return out


def measure(m: int, n: int, k: int, reps: int = 20) -> float:
    import torch

    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        torch.mm(a, b)
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        torch.mm(a, b)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2.0 * m * n * k / statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    import torch

    from tpplan.analysis.cost.gemm import gemm_efficiency
    from tpplan.plan.devices import DEVICES

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default=None, help="device preset (default: from the GPU's name)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gemm_shapes: needs a CUDA GPU", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(0)
    preset = args.preset or ("h200" if "H200" in name else "h100")
    device = DEVICES[preset]
    big = measure(8192, 8192, 8192)
    rate = device.bf16_flops * (device.gemm_fraction or 1.0)
    print(f"{name}, torch {torch.__version__}: 8192³ bf16 at {big / 1e12:.0f} TFLOP/s = "
          f"{big / device.bf16_flops:.3f} of the {preset} preset's peak (gemm_fraction "
          f"{device.gemm_fraction})")
    rows = []
    for label, m, n, k in shapes():
        got = measure(m, n, k)
        f = gemm_efficiency(m, n, k, device, rate)
        rows.append(dict(shape=label, m=m, n=n, k=k, tflops=round(got / 1e12, 1),
                         measured_fraction=round(got / big, 3), model_fraction=round(f, 3)))
    if args.json:
        print(json.dumps(dict(gpu=name, preset=preset, large_tflops=big / 1e12, rows=rows)))
    print("| shape | M × N × K | TFLOP/s | measured / 8192³ | model f |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['shape']} | {r['m']} × {r['n']} × {r['k']} | {r['tflops']} | "
              f"{r['measured_fraction']} | {r['model_fraction']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
