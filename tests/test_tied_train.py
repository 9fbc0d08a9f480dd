"""Tied input and output embeddings through the trainer: a HF Qwen2 with
``tie_word_embeddings`` (weights from a folder holding only ``embed_tokens``, as transformers
saves tied models) trained on 4 gloo processes (tp 2 × dp 2), checkpointed, resumed on tp 4,
and exported with ``tpplan export --format hf``: one weight at every stage, and the resumed
curve equal to one run straight through (made in this test, on one process)."""

import shutil

import pytest
from helpers import run_main, tpplan_cli
from trainrun import metrics, ok, tpplan_train

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _tied_folder(tmp_path, tiny_hf):
    """tiny_hf's Qwen2 tokenizer beside a tied Qwen2 of the same sizes, saved by transformers."""
    src = tiny_hf("qwen2")
    folder = tmp_path / "tied"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / name).exists():
            shutil.copy(src / name, folder / name)
    config = transformers.AutoConfig.from_pretrained(src)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def test_tied_embeddings_train_resume_on_another_tp_and_export_as_one_weight(
        tmp_path, tiny_hf, capsys):
    from safetensors import safe_open

    import tpplan
    from tpplan.checkpoint import latest, read_model_state
    from tpplan.models import build_model

    folder = _tied_folder(tmp_path, tiny_hf)
    files = {k for f in folder.glob("*.safetensors") for k in safe_open(f, "pt").keys()}
    assert "lm_head.weight" not in files  # what a tied HF checkpoint holds
    plan = tmp_path / "plan.yaml"
    rc, out = run_main(capsys, "import-hf", folder, "--tp", "2", "-o", plan)
    assert rc == 0, out
    text = plan.read_text()
    assert "[model.embed_tokens, model.norm, lm_head]" in text  # one FSDP unit owns the tie
    plan.write_text(text.replace(f"model: {{hf_config: {folder}}}",
                                 f"model: {{pretrained: {folder}}}"))

    sets = ["train.steps=3", "checkpoint.interval=2", "data.max_bytes=100000"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    ok(tpplan_train(whole, plan=str(plan), sets=[*sets, "mesh.tp=1"]))
    ok(tpplan_train(parts, nproc=4, plan=str(plan), sets=[*sets, "train.steps=2"]))
    ok(tpplan_train(parts, "--resume", "latest", nproc=4, plan=str(plan), sets=[*sets, "mesh.tp=4"]))
    a, b = metrics(whole), metrics(parts)
    for step in (1, 2, 3):
        assert abs(a[step]["loss"] - b[step]["loss"]) <= 1e-4 * a[step]["loss"], step

    # The checkpoint: both names, one value (moved by training); reloaded, one parameter.
    state = read_model_state(latest(parts / "checkpoints"))
    embed = state["model.embed_tokens.weight"]
    assert torch.equal(state.get("lm_head.weight", embed), embed)
    start = transformers.AutoModelForCausalLM.from_pretrained(folder).model.embed_tokens.weight
    assert not torch.allclose(embed, start)
    model = build_model(tpplan.load(parts / "plan.yaml").model, "cpu")
    model.load_state_dict(state, strict=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight

    # The export: one tensor in the safetensors, tied again by transformers, same logits.
    out = tmp_path / "export"
    tpplan_cli("export", "--format", "hf", "--checkpoint", parts, "-o", out, check=True)
    files = {k for f in out.glob("*.safetensors") for k in safe_open(f, "pt").keys()}
    assert "model.embed_tokens.weight" in files and "lm_head.weight" not in files
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    tokens = torch.randint(0, embed.shape[0], (2, 16))
    with torch.no_grad():
        ours = model.eval()(tokens)
        torch.testing.assert_close(hf(tokens).logits, getattr(ours, "logits", ours),
                                   rtol=1e-5, atol=1e-5)
