"""The non-GEMM term of the step time (tpplan.analysis.cost.non_gemm) held against the traced
step's own operator list: its bytes and kernels are that list's sums (the middle micro-batch
weighted by the accumulation), its extrapolation over blocks equals a whole trace, and its
kernels are the step's memory-bound ones (AdamW's update, the loss's softmax), not its GEMMs."""

from __future__ import annotations

from dataclasses import replace

import pytest
from helpers import PLANS

from tpplan.analysis.analyses import analyze_kernels
from tpplan.analysis.cost.non_gemm import non_gemm_seconds
from tpplan.analysis.dryrun import dry_run
from tpplan.analysis.memory.kernels import kernel_profile
from tpplan.plan.devices import Device

DEV = Device("test", 80 * 2**30, bf16_flops=100e12, intra_node_bandwidth=400e9,
             inter_node_bandwidth=20e9, memory_bandwidth=1e12)
# 4 micro-batches: first, middle (standing for 2), last
SETS = ["mesh.tp=1", "train.seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=1"]


def _by_hand(kc, accum: int) -> tuple[int, int]:
    weight = {"middle": accum - 2}
    kernels = sum(n * weight.get(stage, 1) for (stage, _), (n, _) in kc.ops.items())
    moved = sum(b * weight.get(stage, 1) for (stage, _), (_, b) in kc.ops.items())
    return kernels, moved


def test_non_gemm_term_is_the_traced_operator_list_priced():
    from tpplan.models import build_model

    def whole(result) -> None:  # every block traced: no extrapolation
        result.extra["whole"] = kernel_profile(result.plan.spec, result.mesh,
                                               lambda: build_model(result.plan.spec.model, "meta"),
                                               result.step, 4, None)

    r = dry_run(str(PLANS / "llama.yaml"), 1, SETS, [("kernels", analyze_kernels), ("whole", whole)])
    assert r.ok, (r.errors, r.analysis_errors)
    profile = r.extra["kernels"]
    assert profile["depths"] == [1, 2] and profile["periods"] == 4 and profile["accum"] == 4
    (k1, b1), (k2, b2) = (_by_hand(kc, 4) for kc in profile["traces"])
    kernels, moved = k1 + 3 * (k2 - k1), b1 + 3 * (b2 - b1)  # 4 blocks: 3 more than the first
    # launch floor off: bytes over the bandwidth at the efficiency; a 1 s floor: kernels × 1 s
    bandwidth_only = non_gemm_seconds(profile, DEV, efficiency=0.5, launch=0.0)
    assert bandwidth_only["bytes"] == moved and bandwidth_only["kernels"] == kernels
    assert bandwidth_only["seconds"] == pytest.approx(moved / (DEV.memory_bandwidth * 0.5))
    assert non_gemm_seconds(profile, DEV, launch=1.0)["seconds"] == pytest.approx(kernels)
    # the two shallow traces extrapolate to what the whole model's trace counts
    whole = r.extra["whole"]
    assert whole["depths"] == [None]
    assert _by_hand(whole["traces"][0], 4) == (kernels, moved)
    names = {name for (stage, name) in whole["traces"][0].ops}
    assert any("_log_softmax" in n for n in names) and not any(n.startswith("aten.mm") for n in names)
    assert any(stage == "optimizer" and "addcdiv" in name for stage, name in whole["traces"][0].ops)
    with pytest.raises(ValueError, match="no memory bandwidth"):
        non_gemm_seconds(profile, replace(DEV, memory_bandwidth=None))
