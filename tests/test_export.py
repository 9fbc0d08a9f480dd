"""``tpplan export``: a sharded checkpoint trained on 2x2 becomes one safetensors file that
loads into transformers (HF models) or tpplan (the reference Llama) with the same logits as
the trained model."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import PLANS, ROOT, TEST_PLANS, tpplan_cli

SHORT = ["train.steps=3", "train.seq_len=32", "train.global_batch_size=4",
         "train.micro_batch_size=1", "data.max_bytes=100000", "checkpoint.interval=3"]


def train_2x2(plan: Path, run_dir: Path, *sets: str) -> None:
    args = ["train", "--plan", plan, "--nproc", "4", "--set", f"metrics.run_dir={run_dir}"]
    for s in [*SHORT, *sets]:
        args += ["--set", s]
    tpplan_cli(*args, check=True)


def trained_logits(plan: Path, run_dir: Path, tokens: torch.Tensor, tmp: Path) -> torch.Tensor:
    """Logits of the trained model, loaded back by the trainer's own resharding load onto a
    world of one process: independent of the export path under test."""
    script = textwrap.dedent(f"""
        import torch, tpplan
        from tpplan import checkpoint as ckpt
        from tpplan.models import build_model, materialize
        plan = tpplan.load({str(plan)!r}, ["mesh.tp=1"])
        mesh = plan.build_mesh("cpu")
        model = plan.apply(build_model(plan.model, "meta", real_buffers=True), mesh)
        materialize(model, "cpu")
        opt = torch.optim.AdamW(model.parameters())
        ckpt.load(ckpt.latest(__import__("pathlib").Path({str(run_dir / "checkpoints")!r})),
                  model, opt)
        with torch.no_grad():
            torch.save(model.eval()(torch.load({str(tmp / "tokens.pt")!r})), {str(tmp / "out.pt")!r})
    """)
    torch.save(tokens, tmp / "tokens.pt")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(tmp / "out.pt")


def test_reference_llama_export_loads_into_tpplan(tmp_path):
    from tpplan.byom.export import load_exported

    run_dir = tmp_path / "run"
    train_2x2(PLANS / "llama.yaml", run_dir, "model.kwargs.n_layers=2")
    proc = tpplan_cli("export", "--checkpoint", run_dir, "-o", tmp_path / "out", check=True)
    assert "model.safetensors" in proc.stdout
    tokens = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        exported = load_exported(tmp_path / "out").eval()(tokens)
    torch.testing.assert_close(exported, trained_logits(run_dir / "plan.yaml", run_dir, tokens,
                                                        tmp_path), rtol=1e-5, atol=1e-5)


def test_hf_export_loads_into_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    plan = tmp_path / "plan.yaml"
    tpplan_cli("import-hf", TEST_PLANS / "hf/llama-config.json", "-o", plan, check=True)
    run_dir = tmp_path / "run"
    train_2x2(plan, run_dir)
    tpplan_cli("export", "--checkpoint", run_dir / "checkpoints", "-o", tmp_path / "out",
               check=True)
    assert (tmp_path / "out" / "config.json").is_file()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        exported = hf(tokens).logits
    torch.testing.assert_close(exported, trained_logits(run_dir / "plan.yaml", run_dir, tokens,
                                                        tmp_path), rtol=1e-5, atol=1e-5)


def test_export_without_checkpoint_is_a_clear_error(tmp_path):
    proc = tpplan_cli("export", "--checkpoint", tmp_path, "-o", tmp_path / "out", timeout=60)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "no complete checkpoint" in proc.stderr
