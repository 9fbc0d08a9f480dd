"""How fast a rank's matrix multiplications run, from their shapes.

The cost model's ``compute_efficiency`` is the fraction of the bf16 peak a *large,
well-shaped* GEMM reaches in a training step. A GEMM of shape ``M × N × K`` (output
``M × N``, inner dimension ``K``) reaches a fraction ``f ≤ 1`` of that, from three effects
NVIDIA's "Matrix Multiplication Background User's Guide" (NVIDIA Deep Learning Performance
documentation, sections "Tile quantization" and "Wave quantization", and "Math and memory
bounds") describes, and that He's "What Shapes Do Matrix Multiplications Like?" (2024)
measures on H100s:

- **tile quantization**: the output is computed in ``TILE_M × TILE_N`` tiles (256 × 128,
  the guide's example and cuBLAS's largest bf16 tile) and the inner dimension in steps of
  ``TILE_K`` = 64 (CUTLASS's Hopper and Ampere bf16 main loop); a partial tile costs a
  whole one: ``M·N·K / (⌈M/256⌉·256 · ⌈N/128⌉·128 · ⌈K/64⌉·64)``;
- **wave quantization**: one tile per SM at a time, so ``t`` tiles take ``⌈t/SMs⌉`` waves:
  ``t / (⌈t/SMs⌉ · SMs)`` (108 SMs on an A100, 132 on an H100);
- **memory bound**: a GEMM must read its operands and write its output once, ``2(MK + KN
  + MN)`` bytes in bf16, at the device's memory bandwidth; below the arithmetic intensity
  ``peak / bandwidth`` (the guide's "ops:byte ratio") it waits on memory (the roofline).

``f = (rate-bound time) / max(rate-bound time / (tile × wave), memory time)``. Small
matrices pay all three (a 64 × 256 × 256 GEMM fills 2 of an H100's 132 SMs); a large
square one none. Nothing here was fitted to a measured step; cuBLAS's heuristics pick
smaller tiles (or split K) for small problems, so for them ``f`` is a lower estimate.
A device without ``sms`` (a CPU) has no tile or wave term; without ``memory_bandwidth``
no roofline.
"""

from __future__ import annotations

import functools
import math

from ...plan.devices import Device

__all__ = ["TILE_M", "TILE_N", "TILE_K", "BYTES", "gemm_efficiency", "linear_efficiencies",
           "causal_fraction", "linear_splits", "unit_work"]

TILE_M, TILE_N, TILE_K = 256, 128, 64
BYTES = 2  # bf16 operands


def gemm_efficiency(m: int, n: int, k: int, device: Device, rate: float,
                    batch: int = 1) -> float:
    """The fraction of ``rate`` (FLOP/s of a large, well-shaped GEMM on ``device``) that
    ``batch`` GEMMs of shape ``m × n × k`` reach together (a batched GEMM's tiles share
    the waves)."""
    return _efficiency(int(m), int(n), int(k), int(batch), device.sms or 0,
                       float(device.memory_bandwidth or 0.0), float(rate))


@functools.lru_cache(maxsize=65536)
def _efficiency(m: int, n: int, k: int, batch: int, sms: int, hbm: float, rate: float) -> float:
    if min(m, n, k, batch) <= 0:
        return 1.0
    f = 1.0
    if sms:
        tm, tn, tk = math.ceil(m / TILE_M), math.ceil(n / TILE_N), math.ceil(k / TILE_K)
        f = m * n * k / (tm * TILE_M * tn * TILE_N * tk * TILE_K)
        tiles = tm * tn * batch
        f *= tiles / (math.ceil(tiles / sms) * sms)
    if hbm:
        ideal = 2.0 * m * n * k * batch / rate
        memory = BYTES * (m * k + k * n + m * n) * batch / hbm
        f = ideal / max(ideal / f, memory)
    return f


def linear_efficiencies(tokens: int, in_features: int, out_features: int, device: Device,
                        rate: float) -> tuple[float, float, float]:
    """A Linear's three GEMMs on ``tokens`` rows, with its local (TP-sharded) shape:
    forward ``Y = XWᵀ`` (``tokens × out × in``), the input's gradient ``dX = dY·W``
    (``tokens × in × out``) and the weight's ``dW = dYᵀ·X`` (``out × in × tokens``)."""
    return (gemm_efficiency(tokens, out_features, in_features, device, rate),
            gemm_efficiency(tokens, in_features, out_features, device, rate),
            gemm_efficiency(out_features, in_features, tokens, device, rate))


CAUSAL_BLOCK = 128  # FlashAttention-2's key/value block on the diagonal


def causal_fraction(seq: int) -> float:
    """The share of the ``seq × seq`` score matrix a causal attention kernel computes:
    FlashAttention-2 (Dao 2023, section 3.1.1) skips the blocks above the diagonal, about
    half, and computes the diagonal blocks whole: ``(1 + block/seq) / 2``. The FLOPs
    (and MFU) still count the whole matrix, as PaLM and torchtitan do; the time does not."""
    return min(1.0, 0.5 * (1 + CAUSAL_BLOCK / seq)) if seq > 0 else 1.0


_SPLITS: dict[int, tuple[object, dict[str, str]]] = {}


def linear_splits(rule_of: dict) -> dict[str, str]:
    """Linear path -> the feature its TP style splits, ``in`` or ``out`` (from
    ``parallel.resolve.SHARD_DIMS``: a colwise weight is split on dim 0, its outputs), for
    a resolution's ``rule_of``; cached per ``rule_of`` (``search`` shares resolutions)."""
    hit = _SPLITS.get(id(rule_of))
    if hit is not None and hit[0] is rule_of:
        return hit[1]
    import torch.nn as nn

    from ...parallel.resolve import SHARD_DIMS

    split = {style: "out" if dims["weight"] == 0 else "in"
             for (style, kind), dims in SHARD_DIMS.items() if kind is nn.Linear}
    out = {path: split[r.style.name] for path, r in rule_of.items() if r.style.name in split}
    if len(_SPLITS) > 256:
        _SPLITS.clear()
    _SPLITS[id(rule_of)] = (rule_of, out)
    return out


_WORK: dict[tuple, tuple[object, object, dict]] = {}


def unit_work(flops, splits: dict[str, str], tp: int, tokens: int, micro_batch: int,
              seq: int, device: Device, rate: float) -> dict[str, tuple[float, float]]:
    """Per unit of ``flops`` (:class:`tpplan.analysis.cost.flops.ModelFlops`): ``(forward,
    training, run, op_forward, op_run)``: forward and training FLOPs per token divided by each
    GEMM's efficiency (and causal attention's skipped half), the forward FLOPs the kernels run
    (causal attention's share only), and the same two of the matmuls per-operator
    checkpointing recomputes (every second Linear: :mod:`tpplan.parallel.op_sac` saves the
    outputs of the others and of attention), so that ``FLOPs / rate``
    becomes seconds at the shapes one rank runs: its Linears' local shapes under TP
    (``splits``) on ``tokens`` rows per micro-batch, and attention's ``QKᵀ`` and ``AV`` as
    a batch of ``micro_batch × heads/tp`` GEMMs of ``seq × seq × head_dim`` and ``seq ×
    head_dim × seq``. Equal to the FLOPs where every efficiency is 1. Cached: ``search``
    asks for the same few (tp, micro-batch) many times; the caller must not change it."""
    key = (id(flops), id(splits), tp, tokens, micro_batch, seq, device, rate)
    hit = _WORK.get(key)
    if hit is not None and hit[0] is flops and hit[1] is splits:
        return hit[2]
    if len(_WORK) > 4096:
        _WORK.clear()
    out = _unit_work(flops, splits, tp, tokens, micro_batch, seq, device, rate)
    _WORK[key] = (flops, splits, out)
    return out


def _unit_work(flops, splits, tp, tokens, micro_batch, seq, device, rate):
    heads = flops.attention_heads
    local_heads = heads // tp if heads and heads % tp == 0 else heads
    attn = 0.0
    if heads and flops.attention_width:
        hd = flops.attention_width // heads
        batch = micro_batch * local_heads
        attn = 0.5 / gemm_efficiency(seq, seq, hd, device, rate, batch) + \
            0.5 / gemm_efficiency(seq, hd, seq, device, rate, batch)  # 1 / mean efficiency
        attn *= causal_fraction(seq)  # the time of what the kernel computes
    causal = causal_fraction(seq)
    out = {}
    for unit, forward in flops.forward.items():
        fwd = train = linear = op_fwd = op_run = 0.0
        for n, (path, i, o) in enumerate(flops.linears.get(unit, ())):
            part = splits.get(path) if tp > 1 else None
            li, lo = (i // tp if part == "in" else i), (o // tp if part == "out" else o)
            f, d, w = linear_efficiencies(tokens, li, lo, device, rate)
            fwd += 2.0 * i * o / f
            train += 2.0 * i * o * (1 / f + 1 / d + 1 / w)
            linear += 2.0 * i * o
            if n % 2:  # per-operator checkpointing recomputes every second matmul (op_sac)
                op_fwd += 2.0 * i * o / f
                op_run += 2.0 * i * o
        rest = forward - linear  # attention's matmuls (blocks only)
        run = linear
        if rest > 0:
            fwd += rest * (attn or 1.0)
            train += 3 * rest * (attn or 1.0)
            run += rest * (causal if attn else 1.0)
        out[unit] = (fwd, train, run, op_fwd, op_run)
    return out
