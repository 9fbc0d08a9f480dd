"""Starting from HuggingFace weights (``model.pretrained``): each rank reads its own slices.

Every comparison is against transformers' own single-process forward of the same folder, made
in the test (scripts/make_tiny_hf.py, random weights); the parallel side is the trainer's
path: the model built on meta, parallelized on a gloo mesh, the checkpoint read slice by slice.
"""

from __future__ import annotations

import shutil

import pytest
from helpers import PLANS, tpplan_cli
from trainrun import metrics, ok, tpplan_train

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tpplan.train.pretrained import first_logits  # noqa: E402

HF_PLAN = PLANS / "hf-llama.yaml"  # transformers' plan for Llama; Qwen2 has the same names
BUILTIN_PLAN = PLANS / "llama.yaml"


def plan_file(tmp_path, folder, builtin: bool, name: str = "plan.yaml"):
    model = f"{{name: llama3, config: null, pretrained: {folder}}}" if builtin else \
        f"{{hf: null, pretrained: {folder}}}"
    path = tmp_path / name
    path.write_text(f"extends: {BUILTIN_PLAN if builtin else HF_PLAN}\nmodel: {model}\n")
    return path


def transformers_logits(folder, tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(tokens).logits


def rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("family,dtype,builtin,tp", [
    ("llama", "float32", False, 2),   # HF Llama on 2x2 (TP + loss parallel + FSDP2)
    ("qwen2", "bfloat16", False, 4),  # HF Qwen2 (q/k/v biases), bf16 files into fp32, 1x4
    ("qwen2", "float32", False, 2),   # HF Qwen2 on 2x2
    ("llama", "float32", True, 2),    # the built-in Llama from HF Llama weights, TP + SP, 2x2
    ("llama", "float32", True, 4),    # ... and 1x4
])
def test_logits_at_step_0_equal_transformers(tmp_path, tiny_hf, family, dtype, builtin, tp):
    folder = tiny_hf(family, dtype)
    tokens = torch.randint(0, 512, (4, 16), generator=torch.Generator().manual_seed(0))
    ours = first_logits(str(plan_file(tmp_path, folder, builtin)), [f"mesh.tp={tp}"], 4, tokens)
    assert rel(ours, transformers_logits(folder, tokens)) <= 1e-5


def broken_copy(tmp_path, folder):
    out = tmp_path / "broken"
    shutil.copytree(folder, out)
    return out


def check_fails(tmp_path, folder, *expected, builtin=False, sets=()):
    plan = plan_file(tmp_path, folder, builtin, "bad.yaml")
    args = ["validate", "--plan", plan, "--world-size", "4"]
    for s in sets:
        args += ["--set", s]
    proc = tpplan_cli(*args)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    for text in expected:
        assert text in proc.stderr, proc.stderr
    assert f"{plan}:2:" in proc.stderr  # located at the model line


def test_missing_shard_is_named(tmp_path, tiny_hf):
    folder = broken_copy(tmp_path, tiny_hf("llama"))
    shard = sorted(folder.glob("*.safetensors"))[1]
    shard.unlink()
    check_fails(tmp_path, folder, f"{shard}: missing (the index puts")


def test_wrong_shape_and_unexpected_and_missing_tensors_are_named(tmp_path, tiny_hf):
    from safetensors.torch import load_file, save_file

    folder = broken_copy(tmp_path, tiny_hf("llama"))
    for shard in folder.glob("*.safetensors"):
        tensors = load_file(shard)
        if "model.norm.weight" in tensors:
            tensors["model.norm.weight"] = torch.ones(65)
        for name in [n for n in tensors if ".mlp.up_proj." in n]:
            tensors[name.replace("up_proj", "upper_proj")] = tensors.pop(name)
        save_file(tensors, shard, metadata={"format": "pt"})
    check_fails(tmp_path, folder, "model.norm.weight is [65] in the checkpoint, [64] in the model",
                "missing 2: model.layers.{0-1}.mlp.up_proj.weight",
                "unexpected 2: model.layers.{0-1}.mlp.upper_proj.weight")


def test_config_that_does_not_match_the_plan(tmp_path, tiny_hf):
    plan = tmp_path / "named.yaml"
    plan.write_text(f"extends: {BUILTIN_PLAN}\nmodel: {{name: llama3, config: debug, "
                    f"pretrained: {tiny_hf('llama')}}}\n")
    proc = tpplan_cli("validate", "--plan", plan, "--world-size", "4")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "model.config 'debug' does not match" in proc.stderr
    assert "dim 128 vs 64" in proc.stderr


def test_not_a_checkpoint_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text('{"model_type": "llama"}')
    plan = plan_file(tmp_path, tmp_path / "empty", builtin=True)
    proc = tpplan_cli("validate", "--plan", plan, "--world-size", "4")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "not a Llama the built-in llama3 can hold" in proc.stderr


def first_batch_loss(plan_path, folder, sets) -> float:
    """transformers' loss on the trainer's first global batch (built the trainer's way)."""
    import tpplan
    from tpplan.train.data import global_batch, load_corpus

    plan = tpplan.load(plan_path, sets)
    t = plan.train
    batch = global_batch(load_corpus(plan.data.path, plan.data.max_bytes), t.seed, 1,
                         t.global_batch_size, t.seq_len)
    logits = transformers_logits(folder, batch[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()


def test_fine_tune_resumes_on_another_mesh(tmp_path, tiny_hf):
    """A fine-tune from HF weights starts at transformers' loss, and one stopped at step 2
    and resumed on tp 4 follows the curve of the same fine-tune run through on 2x2."""
    from trainrun import TINY

    folder = tiny_hf("llama")
    plan = plan_file(tmp_path, folder, builtin=False)
    sets = ["train.steps=4", "checkpoint.interval=2", "data.max_bytes=100000"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    run = tpplan_train(whole, nproc=4, sets=sets, plan=str(plan))
    ok(run)
    assert f"(pretrained {folder} (" in run.stdout + run.stderr
    ok(tpplan_train(parts, nproc=4, sets=[*sets, "train.steps=2"], plan=str(plan)))
    ok(tpplan_train(parts, "--resume", "latest", nproc=4, plan=str(plan), sets=[*sets, "mesh.tp=4"]))
    a, b = metrics(whole), metrics(parts)
    expected = first_batch_loss(plan, folder, [s for s in TINY if not s.startswith("model.")] + sets)
    assert abs(a[1]["loss"] - expected) <= 1e-5 * expected
    for step in (1, 2, 3, 4):
        assert abs(a[step]["loss"] - b[step]["loss"]) <= 1e-4 * a[step]["loss"], step
