"""``tpplan export --format hf`` and ``tpplan generate``: a run's checkpoint becomes a folder
transformers loads (same logits as the model tpplan reloads from the checkpoint), sharded,
in bfloat16, with the tokenizer; ``generate`` continues a prompt as a plain greedy loop over
the same model would, from a run or from the export."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import PLANS, run_main, tpplan_cli
from trainrun import QUICK_START

transformers = pytest.importorskip("transformers")

HF_PLAN = """\
mesh: {{tp: 2, dp_shard: -1}}
model: {{hf_config: {folder}}}
tensor_parallel:
  model.embed_tokens: {{style: rowwise, input_layouts: replicate}}
  "model.layers.*.self_attn.{{q_proj,k_proj,v_proj}}": colwise
  "model.layers.*.self_attn.o_proj": rowwise
  "model.layers.*.mlp.{{gate_proj,up_proj}}": colwise
  "model.layers.*.mlp.down_proj": rowwise
  lm_head: {{style: colwise, use_local_output: false}}
loss_parallel: true
fsdp: {{units: [model.embed_tokens, "model.layers.*", [model.norm, lm_head]]}}
train: {{steps: 2, seq_len: 32, global_batch_size: 2, micro_batch_size: 1}}
data: {{max_bytes: 50000}}
"""


@pytest.fixture(scope="module")
def hf_run(tiny_llama, tmp_path_factory) -> Path:
    """``tpplan train`` of that model (its config, random init) on tp=2, two steps."""
    base = tmp_path_factory.mktemp("hfrun")
    (base / "plan.yaml").write_text(HF_PLAN.format(folder=tiny_llama))
    tpplan_cli("train", "--plan", base / "plan.yaml", "--nproc", "2", "--set",
               f"metrics.run_dir={base / 'run'}", *[a for s in QUICK_START for a in ("--set", s)], check=True)
    return base / "run"


def llama_run(tmp: Path, layout: str) -> Path:
    """The built-in Llama trained one step in one process, RoPE in ``layout``."""
    run = tmp / f"llama-{layout}"
    args = ["train", "--plan", PLANS / "llama.yaml", "--set", "mesh.tp=1", "--set",
            f"metrics.run_dir={run}"]
    for s in ["train.steps=1", "train.seq_len=16", "train.global_batch_size=1",
              "model.kwargs.n_layers=1", "model.kwargs.dim=32", "data.max_bytes=20000",
              f"model.kwargs.rope_layout={layout}"]:
        args += ["--set", s]
    tpplan_cli(*args, check=True)
    return run


@pytest.fixture(scope="module")
def interleaved_run(tmp_path_factory) -> Path:
    return llama_run(tmp_path_factory.mktemp("llama"), "interleaved")


def reloaded(run: Path) -> torch.nn.Module:
    """The run's model as tpplan rebuilds it from its plan and newest checkpoint."""
    import tpplan
    from tpplan.checkpoint import latest, read_model_state
    from tpplan.models import build_model

    model = build_model(tpplan.load(run / "plan.yaml").model, "cpu")
    model.load_state_dict(read_model_state(latest(run / "checkpoints")), strict=False)
    return model.eval()


def logits(model, tokens) -> torch.Tensor:
    with torch.no_grad():
        out = model(tokens)
    return getattr(out, "logits", out)


def test_hf_export_of_an_hf_model_gives_its_logits_in_transformers(hf_run, tiny_llama, tmp_path):
    out = tmp_path / "out"
    proc = tpplan_cli("export", "--format", "hf", "--checkpoint", hf_run, "-o", out,
                      "--tokenizer", tiny_llama, check=True)
    assert "1 safetensors file(s)" in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
        "tokenizer.json", "tokenizer_config.json"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, 512, (2, 16))
    torch.testing.assert_close(logits(hf, tokens), logits(reloaded(hf_run), tokens),
                               rtol=1e-5, atol=1e-5)
    ours, theirs = (transformers.AutoTokenizer.from_pretrained(d) for d in (out, tiny_llama))
    text = "def main():\n    return 0"
    assert ours.encode(text) == theirs.encode(text) and ours.chat_template == theirs.chat_template


def test_hf_export_in_shards_and_bfloat16(hf_run, tmp_path):
    out = tmp_path / "out"
    proc = tpplan_cli("export", "--format", "hf", "--checkpoint", hf_run, "-o", out,
                      "--max-shard-size", "40KB", "--dtype", "bfloat16", check=True)
    assert "no tokenizer written" in proc.stdout
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == [p.name for p in shards]
    from safetensors import safe_open

    for shard in shards:  # at most 40 kB of tensors, unless one tensor alone is larger
        with safe_open(shard, "pt") as f:
            sizes = [f.get_slice(k).get_shape() for k in f.keys()]
        nbytes = [2 * torch.Size(s).numel() for s in sizes]
        assert sum(nbytes) <= 40_000 or len(nbytes) == 1
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    expected = {k: v.to(torch.bfloat16) for k, v in reloaded(hf_run).state_dict().items()}
    got = hf.state_dict()
    assert got.keys() == expected.keys()
    for name, tensor in got.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, expected[name]), name


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_builtin_llama_exports_to_hf_llama_with_the_same_logits(layout, interleaved_run, tmp_path):
    """From scratch (interleaved RoPE) the q/k rows are permuted for HF's rotate-half; in
    HF's own layout they are not: either way transformers computes tpplan's logits."""
    run = interleaved_run if layout == "interleaved" else llama_run(tmp_path, layout)
    ours = reloaded(run)
    assert ours.config.rope_layout == layout
    out = tmp_path / "out"
    tpplan_cli("export", "--format", "hf", "--checkpoint", run, "-o", out, check=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    tokens = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(logits(hf, tokens), logits(ours, tokens), rtol=1e-5, atol=1e-5)


def test_hf_export_refuses_what_it_cannot_write_well(capsys, interleaved_run, tiny_llama, tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("mine")
    for args, says in [
        (["-o", full], "it is not empty"),
        (["-o", tmp_path / "a", "--max-shard-size", "lots"], "'lots' is not a size"),
        (["-o", tmp_path / "b", "--tokenizer", tiny_llama], "has 512 tokens, more than the model's "
         "vocabulary of 256"),
    ]:
        rc, printed = run_main(capsys, "export", "--format", "hf", "--checkpoint",
                               interleaved_run, *args)
        assert rc == 1 and says in printed and len(printed.strip().splitlines()) == 1, printed
    assert [p.name for p in full.iterdir()] == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]  # no half-written folder


def test_tokenizer_comes_from_data_tokenizer_else_the_pretrained_folder(tiny_llama, tmp_path):
    from tpplan.byom.tokenizer_files import tokenizer_source

    assert tokenizer_source({"model": {"pretrained": str(tiny_llama)}}) == tiny_llama
    assert tokenizer_source({"data": {"tokenizer": "tok.json"}, "model": {"pretrained": str(tiny_llama)}},
                            tmp_path) == Path("tok.json")
    (tmp_path / "tok.json").write_text("{}")
    assert tokenizer_source({"data": {"tokenizer": "tok.json"}}, tmp_path) == tmp_path / "tok.json"
    assert tokenizer_source({"model": {"hf_config": str(tiny_llama)}, "data": {}}) is None  # bytes


def greedy(model, ids: list[int], n: int, eos: int | None = None) -> list[int]:
    """The plainest greedy decoding: the whole sequence through the model, argmax, append."""
    new = []
    for _ in range(n):
        token = int(logits(model, torch.tensor([ids + new]))[0, -1].argmax())
        if token == eos:
            break
        new.append(token)
    return new


def test_generate_on_a_run_is_greedy_decoding_of_its_model(capsys, interleaved_run):
    from tpplan.cli import main

    prompt = "def main():\n    "
    # In this process: the bytes may include a carriage return, which a text pipe would not keep.
    assert main(["generate", "--checkpoint", str(interleaved_run), "--prompt", prompt,
                 "--max-new-tokens", "12"]) == 0
    printed = capsys.readouterr()
    new = greedy(reloaded(interleaved_run), list(prompt.encode()), 12)
    assert printed.out == bytes(new).decode("utf-8", errors="replace") + "\n"
    assert "12 tokens, greedy, tokenizer bytes" in printed.err


def test_generate_on_an_hf_export_uses_its_tokenizer(hf_run, tiny_llama, tmp_path):
    out = tmp_path / "out"
    tpplan_cli("export", "--format", "hf", "--checkpoint", hf_run, "-o", out, "--tokenizer",
               tiny_llama, check=True)
    prompt = "import os\n"
    proc = tpplan_cli("generate", "--checkpoint", out, "--prompt", prompt, "--max-new-tokens",
                      "8", check=True)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    new = greedy(reloaded(hf_run), tok.encode(prompt), 8, tok.eos_token_id)
    assert proc.stdout == tok.decode(new, skip_special_tokens=True) + "\n"


def test_generate_samples_repeatably_with_a_seed(interleaved_run):
    from tpplan.byom.generate import load_generator, sample

    gen = load_generator(interleaved_run)
    runs = [gen.generate("x = ", 16, temperature=1.0, top_p=0.9, seed=s) for s in (1, 1, 2)]
    assert runs[0] == runs[1] != runs[2]
    probs = torch.tensor([0.1, 0.6, 0.3])
    assert {sample(probs, 0.5) for _ in range(20)} == {1}  # 0.6 alone covers top-p 0.5


def test_generate_mistakes_are_one_line(capsys, interleaved_run, tiny_llama, tmp_path):
    hf = tmp_path / "hf"  # the built-in Llama (256 tokens) with a 512-token tokenizer beside it
    tpplan_cli("export", "--format", "hf", "--checkpoint", interleaved_run, "-o", hf, check=True)
    shutil.copy(tiny_llama / "tokenizer.json", hf)
    for args, says in [
        (["--checkpoint", tmp_path / "none", "--prompt", "x"], "no checkpoint at"),
        (["--checkpoint", interleaved_run, "--prompt", ""], "--prompt is empty"),
        (["--checkpoint", interleaved_run, "--prompt", "x", "--top-p", "0"], "--top-p must be"),
        (["--checkpoint", hf, "--prompt", "def main(): return"], "is beyond the model's "
         "vocabulary (256 tokens)"),
    ]:
        rc, printed = run_main(capsys, "generate", *args)
        assert rc == 1 and says in printed and len(printed.strip().splitlines()) == 1, printed
