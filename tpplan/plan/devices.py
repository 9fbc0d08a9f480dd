"""Accelerators a plan can be checked against: memory, and what the next analyses need.

Pure data, no torch. ``memory`` is what the driver reports as the device's total (what
``nvidia-smi`` prints, ``torch.cuda.mem_get_info()[1]``), not the marketing figure; the
bf16 peak is dense (no 2:4 sparsity, half the datasheet's headline); link bandwidths are
per GPU as the vendor quotes them (NVLink: both directions together; the node's network:
one NIC per GPU, one direction). ``gemm_fraction`` is the rate a large, well-shaped bf16 GEMM
measurably reaches over that peak; ``sms`` and ``memory_bandwidth`` (HBM) feed the GEMM
shape efficiency (wave quantization, the roofline); the three latencies are the α of the
cost model's α–β collectives, seconds, and stay ``None`` for an NVIDIA GPU, whose α comes from
NCCL's own tuning model (docs/search.md). Sources are in docs/dry-run.md ("Device presets").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Device", "DEVICES", "parse_bytes"]

GiB = 2 ** 30
MiB = 2 ** 20


@dataclass(frozen=True)
class Device:
    """One accelerator: its memory in bytes, dense bf16 FLOP/s, and link bandwidths."""

    name: str
    memory: int  # bytes the driver reports as total
    bf16_flops: float | None = None  # dense peak, FLOP/s
    intra_node_bandwidth: float | None = None  # bytes/s per GPU (NVLink, both directions)
    inter_node_bandwidth: float | None = None  # bytes/s per GPU (its NIC, one direction)
    description: str = ""
    sms: int | None = None  # streaming multiprocessors: one GEMM output tile each per wave
    memory_bandwidth: float | None = None  # bytes/s of device memory (HBM)
    collective_latency: float | None = None  # s per collective call (launch); None: NCCL's
    intra_node_latency: float | None = None  # s per algorithm step inside a node
    inter_node_latency: float | None = None  # s per algorithm step across nodes
    gemm_fraction: float | None = None  # a large bf16 GEMM's measured rate / bf16 peak (MAMF)

    def to_json(self) -> dict:
        return {"name": self.name, "description": self.description, "memory": self.memory,
                "bf16_flops": self.bf16_flops,
                "intra_node_bandwidth": self.intra_node_bandwidth,
                "inter_node_bandwidth": self.inter_node_bandwidth,
                "sms": self.sms, "memory_bandwidth": self.memory_bandwidth,
                "collective_latency": self.collective_latency,
                "intra_node_latency": self.intra_node_latency,
                "inter_node_latency": self.inter_node_latency,
                "gemm_fraction": self.gemm_fraction}


DEVICES: dict[str, Device] = {d.name: d for d in (
    Device("h100", 81559 * MiB, 989.4e12, 900e9, 50e9,
           "NVIDIA H100 SXM5 80GB (HBM3), NVLink 4, 400 Gb/s NDR per GPU", 132, 3.35e12,
           gemm_fraction=0.801),
    Device("h200", 141 * 10 ** 9, 989.4e12, 900e9, 50e9,
           "NVIDIA H200 SXM 141GB (HBM3e), NVLink 4, 400 Gb/s NDR per GPU", 132, 4.8e12,
           gemm_fraction=0.801),
    Device("a100-80gb", 81920 * MiB, 312e12, 600e9, 25e9,
           "NVIDIA A100 SXM4 80GB, NVLink 3, 200 Gb/s HDR per GPU", 108, 2.039e12,
           gemm_fraction=0.859),
    Device("a100-40gb", 40960 * MiB, 312e12, 600e9, 25e9,
           "NVIDIA A100 SXM4 40GB, NVLink 3, 200 Gb/s HDR per GPU", 108, 1.555e12,
           gemm_fraction=0.859),
    Device("l40s", 46068 * MiB, 362e12, 64e9, None,
           "NVIDIA L40S 48GB, PCIe Gen4 x16 (no NVLink)", 142, 864e9,
           intra_node_latency=5.7e-6),
)}

_UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def parse_bytes(text: str) -> int:
    """``80GiB``, ``80 GB``, ``85520809984`` -> bytes; ValueError saying what is accepted."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"'{text}' is not a size: write a number and a unit, e.g. 80GiB, "
                         "80GB or 85520809984 (GiB/MiB are powers of 2, GB/MB of 10)")
    return int(float(m.group(1)) * _UNITS[unit])
