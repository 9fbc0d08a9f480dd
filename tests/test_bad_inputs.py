"""Bad inputs that used to end in a traceback, in silence or in exit 0 (issue 27): each is one
located line (or one line naming the input), in every command that reads that input.

Most run ``tpplan.cli.main`` in this process (an exception escaping it is the traceback a
user would see); the out-of-memory case runs the real command under a memory limit.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import pytest
from helpers import PLANS, ROOT, TEST_PLANS, cli_env, run_main

LLAMA = PLANS / "llama.yaml"


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "error:" in line]


# -- a model factory that calls sys.exit -------------------------------------------------------

@pytest.mark.parametrize("command", [["validate", "--world-size", "1"], ["verify", "--nproc", "1"],
                                     ["train"]])
def test_a_factory_that_calls_sys_exit_is_located(capsys, write_plan, command):
    plan = write_plan("mesh: {tp: 1}\nmodel: {factory: 'bad_models:exits', kwargs: {code: 3}}\n")
    rc, out = run_main(capsys, *command, "--plan", plan)
    assert rc == 1
    assert error_lines(out) == [f"{plan}:2:18: error: model.factory 'bad_models:exits' called "
                                "sys.exit(3) (at tests/bad_models.py:31)"]


def test_a_factory_module_that_exits_on_import_is_located(capsys, write_plan, tmp_path,
                                                          monkeypatch):
    (tmp_path / "leaves.py").write_text("import sys\nsys.exit('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    plan = write_plan("model: {factory: 'leaves:build'}\n")
    rc, out = run_main(capsys, "validate", "--plan", plan, "--world-size", "1")
    assert rc == 1 and error_lines(out) == [
        f"{plan}:1:18: error: model.factory: importing 'leaves' called sys.exit('no GPU here') "
        "(at leaves.py:2)"]


# -- a plan, a parent plan or a config that is no regular file ----------------------------------

def test_a_plan_that_is_a_device_or_a_fifo_is_refused_naming_it(capsys, tmp_path):
    fifo = tmp_path / "plan.yaml"
    os.mkfifo(fifo)
    for path, kind in (("/dev/zero", "a character device"), (fifo, "a named pipe (FIFO)")):
        for command in (["validate", "--world-size", "1", "--plan"], ["verify", "--nproc", "1",
                        "--plan"], ["train", "--plan"], ["suggest"]):
            rc, out = run_main(capsys, *command, path)  # would read forever, or block
            assert rc == 1 and out.strip() == (
                f"{path}: error: cannot read plan: it is {kind}, not a YAML file (a plan is "
                "read again by every rank: save it to a file)")


def test_extends_or_hf_config_naming_a_device_is_located(capsys, write_plan):
    plan = write_plan("extends: /dev/zero\nmodel: {name: llama3}\n")
    rc, out = run_main(capsys, "validate", "--plan", plan, "--world-size", "1")
    assert rc == 1 and error_lines(out) == [f"{plan}:1:10: error: 'extends' names '/dev/zero', "
                                            "which is a character device, not a plan (/dev/zero)"]
    pytest.importorskip("transformers")
    plan = write_plan("model: {hf_config: /dev/zero}\n")
    rc, out = run_main(capsys, "validate", "--plan", plan, "--world-size", "1")
    assert rc == 1 and error_lines(out) == [f"{plan}:1:20: error: model.hf_config: cannot read "
                                            "'/dev/zero': it is a character device, not a JSON "
                                            "config"]
    rc, out = run_main(capsys, "import-hf", "/dev/zero")
    assert rc == 1 and out.strip() == ("error: cannot read '/dev/zero': it is a character "
                                       "device, not a JSON config")


# -- prepare_* layouts that do not match the module's inputs or outputs ------------------------

ATTENTION = ("  layers.*.attention: {style: prepare_input, input_layouts: [shard(1), null], "
             "desired_input_layouts: [replicate, null]}")
FEED_FORWARD = ("  layers.*.feed_forward: {style: prepare_input, input_layouts: shard(1), "
                "desired_input_layouts: replicate}")


@pytest.mark.parametrize("rule, message", [
    ("  layers.*.attention: {style: prepare_input, input_layouts: [shard(1), null, null], "
     "desired_input_layouts: [replicate, null, null]}",
     "'layers.0.attention' (Attention) is called with 2 positional inputs, but 'input_layouts' "
     "lists 3: give one layout per positional input, null for one left alone (keyword inputs "
     "take input_kwarg_layouts)"),
    ("  layers.*.attention: {style: prepare_input, input_layouts: [shard(1)], "
     "desired_input_layouts: [replicate]}",
     "'layers.0.attention' (Attention) is called with 2 positional inputs, but 'input_layouts' "
     "lists 1: give one layout per positional input, null for one left alone (keyword inputs "
     "take input_kwarg_layouts)"),
    ("  layers.*.feed_forward: {style: prepare_input_output, input_layouts: shard(1), "
     "desired_input_layouts: replicate, output_layouts: [partial, partial], "
     "desired_output_layouts: [shard(1), shard(1)]}",
     "'layers.0.feed_forward' (FeedForward) returns 1 output, but 'output_layouts' lists 2: "
     "give one layout per output, null for one left alone"),
])
def test_prepare_layouts_counted_against_the_module_are_located(capsys, write_plan, rule,
                                                                message):
    """PyTorch says only "module inputs and input_layouts should have same length!", at run
    time; validate (which runs the model on meta) says which module, both counts, and the
    rule's line, and exits 1."""
    replaced = FEED_FORWARD if "feed_forward" in rule else ATTENTION
    text = LLAMA.read_text().replace(replaced, rule)
    plan = write_plan(text)
    line = text.splitlines().index(rule) + 1
    rc, out = run_main(capsys, "validate", "--plan", plan, "--world-size", "2",
                       "--set", "model.kwargs.n_layers=1")
    assert rc == 1
    assert error_lines(out) == [f"{plan}:{line}:3: error: {message}"]


# -- an HF config field of the wrong type --------------------------------------------------------

def test_an_hf_config_field_of_the_wrong_type_is_located_at_the_field(capsys, write_plan,
                                                                      tmp_path):
    pytest.importorskip("transformers")
    config = (TEST_PLANS / "hf" / "llama-config.json").read_text()
    (tmp_path / "config.json").write_text(config.replace('"num_attention_heads": 4',
                                                         '"num_attention_heads": "four"'))
    assert '"four"' in (tmp_path / "config.json").read_text()
    expected = "expected int, got str (value: 'four')"
    plan = write_plan("model: {hf_config: config.json}\nmesh: {tp: 1}\n")
    for command in (["validate", "--world-size", "1"], ["verify", "--nproc", "1"], ["train"]):
        rc, out = run_main(capsys, *command, "--plan", plan)
        assert rc == 1 and error_lines(out) == [
            f"{plan}:1:20: error: '{tmp_path / 'config.json'}': field 'num_attention_heads': "
            f"{expected}"]
    rc, out = run_main(capsys, "import-hf", tmp_path / "config.json")
    assert rc == 1 and out.strip() == (f"error: '{tmp_path / 'config.json'}': field "
                                       f"'num_attention_heads': {expected}")
    # set in the plan: at the plan's own field
    plan = write_plan("model: {hf: LlamaForCausalLM, config: {hidden_size: 64,\n"
                      "  num_attention_heads: four}}\n")
    rc, out = run_main(capsys, "validate", "--plan", plan, "--world-size", "1")
    assert rc == 1 and error_lines(out) == [
        f"{plan}:2:24: error: model.config.num_attention_heads: {expected}"]


# -- a global batch too large for memory -------------------------------------------------------

def _limit_memory() -> None:
    limit = 16 << 30  # address space: torch (CUDA builds too) fits, a 61 GiB activation does not
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def test_a_batch_too_large_for_memory_is_one_line_at_the_batch(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "tpplan", "train", "--plan", str(LLAMA), "--set", "mesh.tp=1",
         "--set", "train.global_batch_size=1000000", "--set", "train.steps=1", "--set",
         "data.max_bytes=100000", "--set", f"metrics.run_dir={tmp_path / 'run'}"],
        cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=300,
        preexec_fn=_limit_memory)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert error_lines(proc.stderr) == [
        "error: rank 0 ran out of memory (tried to allocate 61.0 GiB): each data-parallel rank "
        "runs micro-batches of 1000000 × 128 tokens (train.global_batch_size at --set "
        "train.global_batch_size=1000000:1:25); lower it, or see the peak per rank first: "
        f"tpplan validate --plan {LLAMA} --world-size 1 --device-memory SIZE"]


# -- verify of a model without an embedding ------------------------------------------------------

def test_verify_of_a_model_without_token_embedding_is_located(capsys, write_plan):
    plan = write_plan("mesh: {tp: 2}\nmodel: {factory: 'toy_models:float_mlp'}\n"
                      "tensor_parallel: {'0': colwise, '1': rowwise}\n")
    rc, out = run_main(capsys, "verify", "--plan", plan, "--nproc", "2")
    assert rc == 1 and error_lines(out) == [
        f"{plan}:2:18: error: model.factory 'toy_models:float_mlp' builds a Sequential with no "
        "token embedding (nn.Embedding) and no config.vocab_size: verify feeds a model a batch "
        "of token ids and cannot tell which ids it takes"]


# -- a plan without a model section --------------------------------------------------------------

@pytest.mark.parametrize("command", [
    ["validate", "--world-size", "1"], ["verify", "--nproc", "1"], ["train"],
    ["search", "--world-size", "1", "--device", "h100"]])
def test_a_plan_without_a_model_is_located_at_its_first_line(capsys, write_plan, command):
    plan = write_plan("mesh: {tp: 1}\n")
    rc, out = run_main(capsys, *command, "--plan", plan)
    assert rc == 1 and error_lines(out) == [
        f"{plan}:1:1: error: the plan has no 'model' section; this command builds the model "
        "from it (model: {name: llama3}, {factory: 'package.module:function'}, {hf: ...} or "
        "{hf_config: ...})"]


# -- validate --require-fit: an exit code a CI job can gate on -----------------------------------

def test_require_fit_exits_3_when_a_rank_does_not_fit(capsys):
    tiny = ["--plan", LLAMA, "--world-size", "1", "--set", "mesh.tp=1",
            "--set", "model.kwargs.n_layers=1"]
    rc, out = run_main(capsys, "validate", *tiny, "--device-memory", "10MiB", "--require-fit")
    assert rc == 3 and "does not fit" in out
    assert error_lines(out) == [next(x for x in out.splitlines() if "--require-fit" in x)]
    assert "more than 10MiB device's 10.00 MiB" in error_lines(out)[0]
    rc, out = run_main(capsys, "validate", *tiny, "--device-memory", "10MiB")
    assert rc == 0 and "does not fit" in out  # the verdict alone, as before
    rc, out = run_main(capsys, "validate", *tiny, "--device-memory", "80GiB", "--require-fit")
    assert rc == 0 and "fits" in out
    rc, out = run_main(capsys, "validate", *tiny, "--device-memory", "10MiB", "--require-fit",
                       "--json")
    assert rc == 3
    rc, out = run_main(capsys, "validate", *tiny, "--require-fit")
    assert rc == 2 and out.strip() == "error: --require-fit needs --device or --device-memory"


# -- the pipeline stage contract, checked on meta before any process group ----------------------

CONTRACT = ("rule 3: a model's forward tolerates the parts a stage does not own, which are None "
            "on that stage (docs/pipeline.md)")


@pytest.mark.parametrize("command", [["validate", "--world-size", "2"], ["verify", "--nproc", "2"],
                                     ["train"]])
def test_a_model_that_breaks_the_stage_contract_is_named_with_the_rule(capsys, write_plan,
                                                                        monkeypatch, command):
    """MiniGPT's forward calls its head and embeddings unconditionally: on a stage they are
    None. It used to fail on a rank with "TypeError: 'NoneType' object is not callable"."""
    if command == ["train"]:  # one rank of a 2-rank launch: its checks run before the group
        monkeypatch.setenv("WORLD_SIZE", "2")
    plan = write_plan("mesh: {pp: 2, tp: 1}\nmodel: {factory: 'toy_models:mini_gpt'}\n"
                      "pipeline: {schedule: gpipe}\ntrain: {global_batch_size: 4, seq_len: 16}\n")
    rc, out = run_main(capsys, *command, "--plan", plan)
    assert rc == 1
    assert error_lines(out) == [
        f"{plan}:3:1: error: pipeline stage 0 (wte, wpe, blocks.0) fails run alone: TypeError: "
        "'NoneType' object is not callable in the model's forward (MiniGPT.forward) (at "
        f"tests/toy_models.py:70); the model breaks the stage contract, {CONTRACT}"]


def test_models_that_keep_the_stage_contract_pass_it(capsys):
    """The built-in Llama and a HuggingFace decoder (through its stage wrapper) split cleanly."""
    for plan, world in ((PLANS / "llama-3d.yaml", 8), (TEST_PLANS / "hf" / "llama-pp.yaml", 4)):
        rc, out = run_main(capsys, "validate", "--plan", plan, "--world-size", world)
        assert rc == 0 and not error_lines(out), out[-2000:]
