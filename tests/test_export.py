"""``tpplan export``: a sharded checkpoint trained on 2x2 becomes one safetensors file that
loads into transformers (HF models) or tpplan (the reference Llama) with the same logits as
the trained model."""

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import PLANS, ROOT, TEST_PLANS, run_main, tpplan_cli
from trainrun import QUICK_START

SHORT = ["train.steps=3", "train.seq_len=32", "train.global_batch_size=4",
         "train.micro_batch_size=1", "data.max_bytes=100000", "checkpoint.interval=3"]


def train_2x2(plan: Path, run_dir: Path, *sets: str) -> None:
    args = ["train", "--plan", plan, "--nproc", "4", "--set", f"metrics.run_dir={run_dir}"]
    for s in [*SHORT, *QUICK_START, *sets]:
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


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory) -> Path:
    """A real run folder with one checkpoint: one process, one step, a tiny Llama."""
    run = tmp_path_factory.mktemp("export") / "run"
    args = ["train", "--plan", PLANS / "llama.yaml", "--set", "mesh.tp=1", "--set",
            f"metrics.run_dir={run}"]
    for s in ["train.steps=1", "train.seq_len=16", "train.global_batch_size=1",
              "model.kwargs.n_layers=1", "model.kwargs.dim=32", "data.max_bytes=20000"]:
        args += ["--set", s]
    tpplan_cli(*args, check=True)
    return run


def _damaged(run: Path, tmp: Path) -> tuple[Path, Path, Path]:
    """A copy of ``run``: (the copy, its checkpoint, its model shard)."""
    copy = tmp / "run"
    shutil.copytree(run, copy)
    ckpt = next((copy / "checkpoints").iterdir())
    return copy, ckpt, next(ckpt.glob("*.distcp"))


def _export_error(capsys, run: Path, out: Path) -> str:
    rc, printed = run_main(capsys, "export", "--checkpoint", run, "-o", out)
    assert rc == 1 and len(printed.strip().splitlines()) == 1, printed
    assert not out.exists() or not list(out.iterdir())  # nothing half-written
    return printed.strip()


def test_export_of_a_truncated_shard_names_the_file(one_process_run, tmp_path):
    run, ckpt, shard = _damaged(one_process_run, tmp_path)
    with open(shard, "r+b") as f:
        f.truncate(1000)
    proc = tpplan_cli("export", "--checkpoint", run, "-o", tmp_path / "out", timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(f"error: checkpoint {ckpt} cannot be read: {shard}: is 1,000 "
                                  "bytes, the manifest says ")
    assert proc.stderr.strip().endswith("(truncated)")
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_export_of_a_missing_shard_or_garbage_metadata_names_the_file(capsys, one_process_run,
                                                                      tmp_path):
    run, ckpt, shard = _damaged(one_process_run, tmp_path)
    shard.unlink()
    assert _export_error(capsys, run, tmp_path / "out") == (
        f"error: checkpoint {ckpt} cannot be read: {shard}: is missing")
    shutil.rmtree(run)
    run, ckpt, shard = _damaged(one_process_run, tmp_path)
    (ckpt / ".metadata").write_bytes(b"\xff" * 64)
    assert _export_error(capsys, run, tmp_path / "out").startswith(
        f"error: checkpoint {ckpt} cannot be read: {ckpt / '.metadata'}: is 64 bytes")


def test_export_of_flipped_shard_bytes_names_the_file(capsys, one_process_run, tmp_path):
    """Same size, other bytes: only the manifest's SHA-256 can tell, and export checks it."""
    run, ckpt, shard = _damaged(one_process_run, tmp_path)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2:len(data) // 2 + 4] = bytes(255 - x for x in data[len(data) // 2:len(data) // 2 + 4])
    shard.write_bytes(bytes(data))
    assert _export_error(capsys, run, tmp_path / "out") == (
        f"error: checkpoint {ckpt} is damaged: {shard}: contents do not match the manifest's "
        "SHA-256 (corrupted on disk)")


def test_export_of_a_shard_the_manifest_does_not_cover_still_names_the_file(
        capsys, one_process_run, tmp_path):
    """A checkpoint whose manifest leaves a shard out (as one written before tpplan kept
    manifests leaves every shard out): the failing read is traced to the file all the same."""
    from torch.distributed.checkpoint import FileSystemReader

    run, ckpt, shard = _damaged(one_process_run, tmp_path)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    del manifest["files"][shard.name]
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    entries = FileSystemReader(str(ckpt)).read_metadata().storage_data
    start = min(info.offset for index, info in entries.items() if index.fqn.startswith("model."))
    data = bytearray(shard.read_bytes())
    data[start:start + 64] = b"\0" * 64  # the header of the first weight's record
    shard.write_bytes(bytes(data))
    assert _export_error(capsys, run, tmp_path / "out").startswith(
        f"error: checkpoint {ckpt} cannot be read: {shard}: corrupt or unreadable (")
    with open(shard, "r+b") as f:
        f.truncate(start + 100)
    assert _export_error(capsys, run, tmp_path / "out").startswith(
        f"error: checkpoint {ckpt} cannot be read: {shard}: truncated ({start + 100:,} bytes; "
        "the checkpoint's metadata needs at least ")


def test_export_refuses_an_output_that_is_a_file_or_an_input(capsys, one_process_run, tmp_path):
    rc, printed = run_main(capsys, "export", "--checkpoint", one_process_run, "-o",
                           one_process_run / "plan.yaml")
    assert rc == 1 and printed.strip() == (f"error: cannot write to '{one_process_run / 'plan.yaml'}'"
                                           ": it is a file; -o names a folder")
    # A plan whose hf_config is the config.json export would write: refused, nothing written.
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text('{"model_type": "llama"}')
    plan = tmp_path / "hf-plan.yaml"
    plan.write_text("model: {hf_config: hf/config.json}\n")
    rc, printed = run_main(capsys, "export", "--checkpoint", one_process_run, "--plan", plan,
                           "-o", out)
    assert rc == 1 and printed.strip() == (
        f"error: refusing to write '{out / 'config.json'}': it is the model's hf_config "
        f"({out / 'config.json'}), which this command reads; choose another output")
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]
    assert (out / "config.json").read_text() == '{"model_type": "llama"}'


def test_export_with_a_missing_plan_names_it(capsys, one_process_run, tmp_path):
    rc, printed = run_main(capsys, "export", "--checkpoint", one_process_run, "--plan",
                           tmp_path / "missing.yaml", "-o", tmp_path / "out")
    assert rc == 1 and printed.strip() == (f"{tmp_path / 'missing.yaml'}: error: cannot read "
                                           "plan: No such file or directory")


def test_export_with_a_plan_that_does_not_fit_the_checkpoint_is_located(capsys, one_process_run,
                                                                        tmp_path):
    """The run trained a 1-block, width-32 Llama; the shipped plan's is 2 blocks of 256 and a
    factory model has other names: each is refused at the plan's model line, nothing written
    (it used to export the checkpoint under either plan, exit 0)."""
    ckpt = next((one_process_run / "checkpoints").glob("step-*"))
    rc, out = run_main(capsys, "export", "--checkpoint", one_process_run, "--plan",
                       PLANS / "llama.yaml", "-o", tmp_path / "a")
    assert rc == 1 and out.splitlines()[0].startswith(
        f"{PLANS / 'llama.yaml'}:4:1: error: checkpoint {ckpt} does not fit this plan's model "
        "(llama3 debug): ")
    assert "have other shapes: tok_embeddings.weight [256, 32] (the plan's model: [256, " in out
    assert "pass --plan with the plan the run used" in out
    plan = tmp_path / "gpt.yaml"
    plan.write_text("model: {factory: 'toy_models:mini_gpt'}\n")
    rc, out = run_main(capsys, "export", "--checkpoint", one_process_run, "--plan", plan,
                       "-o", tmp_path / "b")
    assert rc == 1 and out.splitlines()[0].startswith(
        f"{plan}:1:1: error: checkpoint {ckpt} does not fit this plan's model "
        "(toy_models:mini_gpt): ")
    assert "of its tensors are not the model's: tok_embeddings.weight" in out
    assert not any((tmp_path / d / "model.safetensors").exists() for d in "ab")
    rc, out = run_main(capsys, "export", "--checkpoint", one_process_run, "-o", tmp_path / "c")
    assert rc == 0 and (tmp_path / "c" / "model.safetensors").is_file()  # the run's own plan
