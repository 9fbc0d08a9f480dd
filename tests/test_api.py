"""The Python API a user's own training loop gets: load, build_mesh, apply, loss_context."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import tpplan_cli

import tpplan
from tpplan.models import build_model
from tpplan.parallel.apply import apply_ac
from tpplan.plan.patterns import compile_pattern
from tpplan.plan.styles import Layout


@pytest.mark.parametrize("pattern,path,hit", [
    ("layers.*.attention", "layers.12.attention", True),
    ("layers.*.attention", "layers.12.attention.wq", False),  # '*' is one segment
    ("layers.*", "layers.3", True),
    ("layers.*.attention.{wq,wk,wv}", "layers.0.attention.wk", True),
    ("layers.*.attention.{wq,wk,wv}", "layers.0.attention.wo", False),
    ("layers.?.ffn_norm", "layers.7.ffn_norm", True),
    ("re:layers\\.(0|1)\\.attention", "layers.1.attention", True),
    ("re:layers\\.(0|1)\\.attention", "layers.2.attention", False),
])
def test_patterns(pattern, path, hit):
    assert (compile_pattern(pattern).fullmatch(path) is not None) == hit


def test_extends_inherits_and_overrides(root):
    tp = tpplan.load(root / "plans/llama-tp.yaml")
    base = tpplan.load(root / "plans/llama.yaml")
    assert (tp.mesh.tp, base.mesh.tp) == (4, 2)
    assert tp.model == base.model or tp.model.name == base.model.name == "llama3"
    styles = {r.pattern: r.style.describe() for r in tp.rules}
    assert "layers.*.attention_norm" not in styles  # removed with null
    assert styles["layers.*.attention.wo"] == "rowwise"  # replaced whole, no output_layouts
    assert styles["layers.*.attention.{wq,wk,wv}"] == "colwise"  # inherited
    assert tp.loss_parallel and tp.fsdp.units == base.fsdp.units


def test_overrides_any_key(root):
    plan = tpplan.load(root / "plans/llama.yaml", overrides=[
        "model.config=70b", "mesh.tp=8", "fsdp.reshard_after_forward=false",
        "tensor_parallel.layers.*.attention.wo=rowwise", "train.seq_len=512"])
    assert (plan.model.config, plan.mesh.tp, plan.fsdp.reshard_after_forward) == ("70b", 8, False)
    assert {r.pattern: r.style.describe() for r in plan.rules}["layers.*.attention.wo"] == "rowwise"
    assert plan.train.seq_len == 512  # the typed section
    assert plan.section("train")["seq_len"] == 512  # the section as written, located


def test_huggingface_tp_plan_strings(write_plan):
    path = write_plan("model: {name: llama3}\ntensor_parallel:\n"
                      "  layers.*.attention.{wq,wk,wv}: colwise_rep\n"
                      "  layers.*.attention.wo: rowwise_rep\n"
                      "  norm: replicate\n  layers.*.ffn_norm: sequence_parallel\n")
    rules = {r.pattern: r.style for r in tpplan.load(path).rules}
    assert rules["layers.*.attention.{wq,wk,wv}"].name == "colwise"
    assert rules["layers.*.attention.{wq,wk,wv}"].options == {"output_layouts": Layout("replicate")}
    assert rules["layers.*.attention.wo"].options == {"input_layouts": Layout("replicate")}
    assert rules["norm"].name == "replicate"


def test_resolve_reports_which_rule_hit_which_modules(root):
    plan = tpplan.load(root / "plans/llama.yaml")
    res = plan.check(build_model(plan.model, "meta"), world_size=4)
    hits = {rule.pattern: paths for rule, paths in res.rules}
    assert hits["layers.*.attention.{wq,wk,wv}"][:3] == [
        "layers.0.attention.wq", "layers.0.attention.wk", "layers.0.attention.wv"]
    assert len(hits["layers.*.attention.{wq,wk,wv}"]) == 12
    assert [paths for _, paths in res.units] == [
        ["tok_embeddings"], [f"layers.{i}" for i in range(4)], ["norm", "output"]]


def test_plan_reading_imports_no_torch(root):
    code = ("import sys, tpplan; tpplan.load('plans/llama.yaml'); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_user_loop_on_a_meta_model_one_process(root):
    """load -> build_mesh -> apply on meta -> materialize -> loss under loss_context."""
    script = textwrap.dedent("""
        import torch, torch.nn.functional as F, tpplan
        from tpplan.models import build_model
        plan = tpplan.load("plans/llama.yaml", overrides=["mesh.tp=1"])
        mesh = plan.build_mesh("cpu")
        model = plan.apply(build_model(plan.model, "meta"), mesh)
        model.to_empty(device="cpu")
        model.init_buffers("cpu")
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.02)
        x = torch.randint(0, 256, (2, 17))
        with plan.loss_context():
            loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
        print(round(loss.item(), 1), len(plan.last_report.modules))
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    loss, rows = out.stdout.split()
    assert abs(float(loss) - torch.log(torch.tensor(256.0)).item()) < 0.2  # near-uniform start
    assert int(rows) > 0


def test_validate_json(root):
    out = tpplan_cli("validate", "--plan", "plans/llama.yaml", "--world-size", "8", "--json",
                     check=True)
    data = json.loads(out.stdout)
    assert data["ok"] and data["errors"] == [] and data["world_size"] == 8
    assert data["mesh"] == {"dp_replicate": 1, "dp_shard": 4, "tp": 2}
    wq = next(m for m in data["modules"] if m["path"] == "layers.0.attention.wq")
    assert wq["rule"] == "llama.yaml:13" and wq["style"] == "colwise"
    (weight,) = wq["params"]
    assert weight["global_shape"] == [128, 128]
    assert weight["local_shape"] == [16, 128]  # 128 / tp 2 / dp_shard 4
    assert weight["placements"].endswith("tp:S(0)")


def test_validate_70b_at_1024_ranks(root):
    # 512 data-parallel ranks need a global batch that splits over them, as train would.
    out = tpplan_cli("validate", "--plan", "plans/llama.yaml", "--set", "model.config=70b",
                     "--set", "train.global_batch_size=1024", "--world-size", "1024", "--json",
                     check=True)
    data = json.loads(out.stdout)
    assert data["mesh"] == {"dp_replicate": 1, "dp_shard": 512, "tp": 2}
    assert (data["step"]["micro_batch_size"], data["step"]["grad_accum"]) == (2, 1)
    assert len([m for m in data["modules"] if m["path"].endswith("attention.wq")]) == 80


def test_activation_checkpointing_every_n_blocks(root):
    """selective every 2: blocks 0 and 2 recompute in backward, 1 and 3 keep activations."""
    plan = tpplan.load(root / "plans/llama.yaml",
                       ["activation_checkpointing={mode: selective, every: 2}"])
    assert (plan.activation_checkpointing.mode, plan.activation_checkpointing.every) == ("selective", 2)
    model = build_model(plan.model, "cpu")
    res = plan.resolve(model, world_size=2)
    apply_ac(model, res.ac_blocks, plan.activation_checkpointing.every)
    wrapped = ["forward" in vars(block) for block in model.layers]
    assert wrapped == [True, False, True, False]
    x = torch.randint(0, 256, (1, 8))
    model(x).sum().backward()  # runs through the checkpointed blocks
    assert all(p.grad is not None for p in model.parameters())


def test_compile_section(root):
    plan = tpplan.load(root / "plans/llama.yaml", ["compile={blocks: 'layers.*', fullgraph: true}"])
    assert (plan.compile.enabled, plan.compile.blocks, plan.compile.fullgraph) == (True, "layers.*", True)
    assert not tpplan.load(root / "plans/llama.yaml", ["compile=false"]).compile.enabled
    assert tpplan.load(root / "plans/llama.yaml", ["compile=true"]).compile.enabled


def test_a_meta_build_runs_no_initializer_and_keeps_every_shape():
    """On meta there are no values to write: building the plan's model runs none of
    ``nn.init``'s kernels (which take their tensor as a keyword, ``tensor=``), and builds the
    same parameters, shapes and buffers as a build on the CPU."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tpplan.plan.specs import ModelSpec

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    spec = ModelSpec(name="llama3", config="debug")
    with Ops() as ops:
        meta = build_model(spec, "meta")
    inits = [n for n in ops.names if n.split(".")[0] in ("uniform_", "normal_", "fill_", "zero_")]
    assert not inits, inits
    cpu = build_model(spec, "cpu")
    assert [(n, p.shape) for n, p in meta.named_parameters()] == \
        [(n, p.shape) for n, p in cpu.named_parameters()]
    assert [(n, b.shape) for n, b in meta.named_buffers()] == \
        [(n, b.shape) for n, b in cpu.named_buffers()]


def test_validate_gives_the_collector_its_pace_back(root, capsys):
    """`validate` collects cyclic garbage less often while it runs (docs/benchmarks.md); a
    caller that runs it in its own process gets the collector back at the pace it had."""
    import gc

    from tpplan.cli import main

    before = gc.get_threshold()
    try:
        gc.set_threshold(500, 9, 9)
        assert main(["validate", "--plan", str(root / "plans/llama.yaml"), "--world-size", "8",
                     "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["ok"]
        assert gc.get_threshold() == (500, 9, 9)
    finally:
        gc.set_threshold(*before)
