"""The step's fast paths that a CPU can check: FlexAttention's document masking equals the
dense mask (eager FlexAttention runs forward on CPU; its backward is CUDA-only), and
torch.compile is the default on CUDA only (a plan that leaves ``compile`` out compiles its
blocks on CUDA, stays eager on CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tpplan.models.flex import document_ids, flex_document_attention, use_flex
from tpplan.models.llama import document_mask


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_document_attention_equals_the_dense_mask():
    torch.manual_seed(0)
    bs, h, kv, s, hd = 2, 4, 2, 160, 8  # 160: a partial 128-tile; GQA 4 query heads on 2 kv
    # row 0: documents of 50, 90, 20 tokens; row 1: one document (positions 0..159)
    positions = torch.cat([torch.arange(50), torch.arange(90), torch.arange(20)])
    positions = torch.stack([positions, torch.arange(s)])
    # forward only: PyTorch's FlexAttention has no backward on CPU (the GPU check runs it)
    q, k, v = torch.randn(bs, h, s, hd), torch.randn(bs, kv, s, hd), torch.randn(bs, kv, s, hd)
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(positions), enable_gqa=True)
    flex = flex_document_attention(q, k, v, positions)
    assert torch.allclose(flex, dense, atol=1e-5), (flex - dense).abs().max()
    # a document's first token sees itself only: its output is its own value (the mask bites)
    assert torch.allclose(flex[0, :, 50], v[0].repeat_interleave(2, 0)[:, 50], atol=1e-6)
    assert document_ids(positions)[0].tolist() == [0] * 50 + [1] * 90 + [2] * 20
    assert not use_flex(q)  # CPU, eager: the built-in Llama keeps the dense mask


def test_compile_left_out_is_on_for_cuda_only(tmp_path):
    import tpplan
    from tpplan.models.llama import build
    from tpplan.plan.specs import CompileSpec

    plan = tpplan.load("plans/llama.yaml", ["mesh.tp=1"])
    assert plan.compile.enabled is None
    assert plan.compile.on("cuda") and not plan.compile.on("cpu")
    assert not plan.compile.on("cuda", eager_only=True)  # pipeline stages, context parallel
    assert not CompileSpec(enabled=False).on("cuda") and CompileSpec(enabled=True).on("cpu")
    assert tpplan.load("plans/llama.yaml", ["compile=false"]).compile.enabled is False
    with torch.device("meta"):
        model = build("debug")
    res = plan.resolve(model, 1)
    assert not res.errors and res.compile_blocks == [f"layers.{i}" for i in range(4)]
    # a model without the default blocks: nothing to compile, and no error for a key left out
    user = tmp_path / "user.yaml"
    user.write_text("mesh: {tp: 1}\nmodel: {factory: 'toy_models:float_mlp'}\n")
    loaded = tpplan.load(user)
    res = loaded.resolve(torch.nn.Sequential(torch.nn.Linear(2, 2)), 1)
    assert not res.errors and res.compile_blocks == []


def test_float8_refused_located_on_cpu_and_old_gpus(tmp_path):
    """``float8`` needs CUDA at compute capability 8.9+: ``tpplan train`` on CPU refuses it at
    the section's line before any process group; an A100 (8.0) likewise (tp > 1 composes: tests/test_float8.py)."""
    import importlib.util

    from helpers import ROOT

    import tpplan
    from tpplan.parallel.float8 import float8_problems

    plan = tmp_path / "f8.yaml"
    plan.write_text(f"extends: {ROOT / 'plans/llama.yaml'}\nmesh: {{tp: 1}}\nfloat8:\n"
                    "  linears: ['layers.*.feed_forward.w1']\n  scaling: rowwise\n")
    import torch.distributed as dist

    from tpplan.plan.errors import PlanErrors
    from tpplan.train.loop import train

    with pytest.raises(PlanErrors) as e:  # the trainer's own entry (`tpplan train` prints it)
        train(str(plan), ["train.steps=1", f"metrics.run_dir={tmp_path / 'run'}"], device_type="cpu")
    out = str(e.value)
    assert f"{plan}:4:3: 'float8'" in out and "this run is on cpu" in out, out
    assert not dist.is_initialized()  # refused before any process group
    spec = tpplan.load(plan).spec
    (a100,) = float8_problems(spec, "cuda", (8, 0), "NVIDIA A100")
    assert "capability 8.9" in a100.message and "NVIDIA A100 has 8.0" in a100.message
    hopper = float8_problems(spec, "cuda", (9, 0), "NVIDIA H200")
    if importlib.util.find_spec("torchao") is None:
        assert "torchao is not installed" in hopper[0].message
    else:
        assert not hopper
    assert not float8_problems(tpplan.load("plans/llama.yaml").spec, "cpu")  # no section: nothing
