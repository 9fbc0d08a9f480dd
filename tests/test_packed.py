"""Packed parameters (``packed_colwise``: Phi-3's qkv_proj and gate_up_proj;
``experts_colwise_rowwise``: Mixtral's routed experts) through weights in and out: HF
safetensors read slice by slice into tp 2 x dp 2, a DCP checkpoint saved there (after one
AdamW step) and loaded on tp 4, read back in one process, and exported as an HF folder --
every tensor in the model's own order, equal to the single-process one. One spawn of 4."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers import ROOT

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(ROOT / "scripts"))

import sweep_hf  # noqa: E402

PHI3 = """mesh: {{tp: {tp}, dp_shard: -1}}
model: {{hf: null, pretrained: {folder}}}
tensor_parallel:
  "model.layers.*.self_attn.qkv_proj":
    {{style: packed_colwise, parts: [num_attention_heads, num_key_value_heads, num_key_value_heads]}}
  "model.layers.*.self_attn.o_proj": rowwise
  "model.layers.*.mlp.gate_up_proj": {{style: packed_colwise, parts: 2}}
  "model.layers.*.mlp.down_proj": rowwise
fsdp: {{units: ["model.layers.*"]}}
"""
MIXTRAL = """mesh: {{tp: {tp}, dp_shard: -1}}
model: {{hf_config: {folder}/config.json}}
tensor_parallel:
  "model.layers.*.mlp.experts": experts_colwise_rowwise
fsdp: {{units: ["model.layers.*"]}}
"""


def _full(model) -> dict:
    """Every parameter whole, in the model's order (packed ones un-interleaved)."""
    from torch.distributed.tensor import DTensor

    from tpplan.parallel.tp.packed import to_model_order
    from tpplan.plan.packing import packed_params

    packed = packed_params(model)
    out = {}
    for n, p in model.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        out[n] = to_model_order(t, packed[n]) if n in packed else t
    return out


def _exp_avg(model, opt) -> dict:
    from tpplan.parallel.tp.packed import to_model_order
    from tpplan.plan.packing import packed_params

    packed = packed_params(model)
    out = {}
    for n, p in model.named_parameters():
        t = opt.state[p]["exp_avg"].full_tensor()
        out[n] = to_model_order(t, packed[n]) if n in packed else t
    return out


def _build(plan_path: str, overrides, pretrained: bool):
    import tpplan
    from tpplan.models import build_model, materialize
    from tpplan.train import pretrained as hf

    plan = tpplan.load(plan_path, overrides)
    if pretrained:
        model = build_model(plan.model, device="meta", real_buffers=True)
        source = hf.check(plan.model, model)
        model = plan.apply(model, plan.build_mesh("cpu"))
        materialize(model, "cpu")
        hf.load(source, model)
    else:  # the seeded model built whole, as verify builds it
        torch.manual_seed(0)
        model = plan.apply(build_model(plan.model, device="cpu"), plan.build_mesh("cpu"))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _worker(rank, world, port, cases, out):
    import torch.distributed as dist

    from tpplan.checkpoint import sharded
    from tpplan.parallel.runtime import as_spawned_rank

    as_spawned_rank(rank, world, port)
    try:
        for name, plan_path, pretrained in cases:
            model, opt = _build(plan_path, ["mesh.tp=2"], pretrained)
            loaded = _full(model)
            tokens = torch.arange(16).reshape(2, 8) % 64
            model(tokens).float().pow(2).mean().backward()
            opt.step()
            path = sharded.save(Path(out) / name, 1, model, opt, {"step": 1}, keep=1)
            before = (_full(model), _exp_avg(model, opt))
            model4, opt4 = _build(plan_path, ["mesh.tp=4"], False)
            sharded.load(path, model4, opt4)
            after = (_full(model4), _exp_avg(model4, opt4))
            if rank == 0:
                torch.save({"loaded": loaded, "before": before, "after": after, "path": str(path)},
                           Path(out) / f"{name}.pt")
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _hf_folder(tmp_path: Path, family: str, **fields) -> Path:
    folder = tmp_path / family
    config = transformers.AutoConfig.for_model(**sweep_hf.tiny_config(family, **fields))
    torch.manual_seed(1)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def test_packed_weights_load_checkpoint_reshard_and_export(tmp_path):
    from safetensors.torch import load_file

    from tpplan.byom.export_hf import export_hf
    from tpplan.checkpoint.sharded import read_model_state
    from tpplan.parallel.runtime import spawn

    # grouped-query attention with parts tp 4 divides: 8 query heads, 4 KV heads
    phi3 = _hf_folder(tmp_path, "phi3", num_attention_heads=8, num_key_value_heads=4,
                      hidden_size=64, head_dim=8, vocab_size=64)
    mixtral = _hf_folder(tmp_path, "mixtral", vocab_size=64)
    cases = []
    for name, text, folder, pretrained in (("phi3", PHI3, phi3, True),
                                           ("mixtral", MIXTRAL, mixtral, False)):
        plan = tmp_path / f"{name}.yaml"
        plan.write_text(text.format(tp=2, folder=folder))
        cases.append((name, str(plan), pretrained))
    spawn(_worker, 4, cases, str(tmp_path))

    hf = load_file(str(phi3 / "model.safetensors"))
    for name, _, _ in cases:
        got = torch.load(tmp_path / f"{name}.pt")
        before, after = got["before"], got["after"]
        if name == "phi3":  # HF weights read into tp 2 x dp 2 part by part
            assert got["loaded"].keys() <= hf.keys()
            for n, t in got["loaded"].items():
                assert torch.equal(t, hf[n]), n
        for part in (0, 1):  # parameters and AdamW's exp_avg, tp 2 -> tp 4
            assert before[part].keys() == after[part].keys()
            for n in before[part]:
                assert torch.equal(before[part][n], after[part][n]), (name, part, n)
        on_disk = read_model_state(Path(got["path"]))  # one process, no group: model order
        for n, t in before[0].items():
            assert torch.equal(on_disk[n], t), (name, n)
        if name == "phi3":
            out = tmp_path / "exported"
            export_hf(Path(got["path"]), out, tmp_path / "phi3.yaml")
            exported = load_file(str(next(out.glob("*.safetensors"))))
            for n, t in before[0].items():
                assert torch.equal(exported[n], t), n
            cfg = json.loads((out / "config.json").read_text())
            assert cfg["num_key_value_heads"] == 4  # the full model's config, not a rank's


def test_validate_reports_packed_and_expert_shards_divided_by_tp(tmp_path, capsys):
    from helpers import run_main

    config = tmp_path / "config.json"
    config.write_text(json.dumps(sweep_hf.tiny_config("mixtral")))
    plan = tmp_path / "plan.yaml"
    rc, out = run_main(capsys, "import-hf", config, "--tp", "2", "-o", plan)
    assert rc == 0, out
    rc, out = run_main(capsys, "validate", "--plan", plan, "--world-size", "2", "--json")
    assert rc == 0, out
    params = {f"{m['path']}.{p['name']}": p for m in json.loads(out[out.index("{"):])["modules"]
              for p in m["params"]}
    gate_up, down = (params[f"model.layers.0.mlp.experts.{n}"] for n in ("gate_up_proj", "down_proj"))
    experts, two_inter, hidden = gate_up["global_shape"]
    assert gate_up["local_shape"] == [experts, two_inter // 2, hidden]
    assert down["local_shape"] == [experts, hidden, two_inter // 4]


def test_packed_rules_that_do_not_fit_are_located_errors(tmp_path, capsys):
    from helpers import run_main

    config = tmp_path / "config.json"
    config.write_text(json.dumps(sweep_hf.tiny_config("phi3")))  # 4 heads, 2 KV heads
    cases = [("parts: 1", "plan.yaml:4:", "a number of equal parts (2 or more)"),
             ("parts: [num_attention_heads, num_kv]", "plan.yaml:4:",
              "part 'num_kv' names no positive integer attribute"),
             ("parts: [1, 2, 4]", "plan.yaml:4:", "cannot be parts of relative sizes [1, 2, 4]"),
             ("parts: [num_attention_heads, num_key_value_heads, num_key_value_heads]",
              "plan.yaml:4:", "packed part 1 has 2 heads and tp=4 does not divide 2")]
    for parts, where, message in cases:
        plan = tmp_path / "plan.yaml"
        plan.write_text(f"""mesh: {{tp: 4}}
model: {{hf_config: {config}}}
tensor_parallel:
  "model.layers.*.self_attn.qkv_proj": {{style: packed_colwise, {parts}}}
  "model.layers.*.self_attn.o_proj": rowwise
""")
        rc, out = run_main(capsys, "validate", "--plan", plan, "--world-size", "4")
        assert rc == 1 and "Traceback" not in out, out
        assert where in out and message in out, out
