"""A model that cannot be built, or a plan unit the model cannot run, is one located error.

Factories that raise, return no module or do not import; sizes of zero or below; FSDP units,
checkpointing and compile blocks on a container that has no forward. Each test checks what
``tpplan validate`` prints: the exit code, the one ``file:line:col: error:`` line, no
traceback (``run_main`` fails the test on an escaping exception).
"""

import pytest
from helpers import PLANS, run_main, tpplan_cli

LLAMA = PLANS / "llama.yaml"


def validate(capsys, plan, *sets, world=4) -> tuple[int, list[str]]:
    args = ["validate", "--plan", plan, "--world-size", world]
    for s in sets:
        args += ["--set", s]
    rc, out = run_main(capsys, *args)
    return rc, [line for line in out.splitlines() if "error:" in line]


def factory_plan(write_plan, factory: str, kwargs: str = "") -> tuple[str, str]:
    """A one-rank plan of ``factory``; returns its path and where the factory value stands."""
    text = f'model: {{factory: "{factory}"{kwargs}}}\n'
    return write_plan(text), f"1:{text.index(chr(34)) + 1}"


@pytest.mark.parametrize("factory, message", [
    ("bad_models:raises", "model.factory 'bad_models:raises' raised ValueError: width 8 must be "
                          "even (at "),
    ("bad_models:returns_none", "model.factory 'bad_models:returns_none' returned None, not a "
                                "torch.nn.Module"),
    ("bad_models:returns_dict", "model.factory 'bad_models:returns_dict' returned a dict ("),
    ("bad_models:returns_container", "model.factory 'bad_models:returns_container' returned a "
                                     "ModuleList, which has no forward of its own; return the "
                                     "model that runs it"),
    ("bad_models:negative_width", "model.factory 'bad_models:negative_width' raised "
                                  "RuntimeError: Trying to create tensor with negative dimension"),
])
def test_a_factory_that_fails_is_located_at_the_factory(capsys, write_plan, factory, message):
    plan, where = factory_plan(write_plan, factory)
    rc, errors = validate(capsys, plan, world=1)
    assert rc == 1 and len(errors) == 1
    assert errors[0].startswith(f"{plan}:{where}: error: {message}")
    if factory.endswith("raises"):  # where in the user's code
        assert errors[0].endswith("bad_models.py:9)")


def test_a_factory_kwarg_it_does_not_take_is_located_at_the_kwarg(capsys, write_plan):
    plan, _ = factory_plan(write_plan, "bad_models:raises", ", kwargs: {width: 4, depth: 2}")
    rc, errors = validate(capsys, plan, world=1)
    assert rc == 1
    column = open(plan).read().index("depth: 2") + 8  # the value 2, counted from 1
    assert errors == [f"{plan}:1:{column}: error: model.factory 'bad_models:raises' raised TypeError: "
                      "raises() got an unexpected keyword argument 'depth'"]


def test_a_factory_module_with_a_syntax_error_names_the_source_line(capsys, write_plan, tmp_path,
                                                                    monkeypatch):
    (tmp_path / "broken_syntax_models.py").write_text("import torch\n\ndef build(:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    plan, where = factory_plan(write_plan, "broken_syntax_models:build")
    rc, errors = validate(capsys, plan, world=1)
    assert rc == 1
    assert errors == [f"{plan}:{where}: error: model.factory: cannot import "
                      "'broken_syntax_models': invalid syntax at broken_syntax_models.py:3:11"]


def test_a_factory_module_whose_import_fails_names_its_line(capsys, write_plan, tmp_path,
                                                            monkeypatch):
    (tmp_path / "missing_dep_models.py").write_text("import os\nimport no_such_package_xyz\n")
    (tmp_path / "failing_models.py").write_text("SIZES = {}\nWIDTH = SIZES['small']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    plan, where = factory_plan(write_plan, "missing_dep_models:build")
    rc, errors = validate(capsys, plan, world=1)
    assert errors == [f"{plan}:{where}: error: model.factory: cannot import 'missing_dep_models': "
                      "No module named 'no_such_package_xyz' (at missing_dep_models.py:2)"]
    plan, where = factory_plan(write_plan, "failing_models:build")
    rc, errors = validate(capsys, plan, world=1)
    assert rc == 1
    assert errors == [f"{plan}:{where}: error: model.factory: importing 'failing_models' raised "
                      "KeyError: 'small' (at failing_models.py:2)"]


def test_a_failing_factory_is_no_traceback_from_the_real_command(write_plan):
    plan, where = factory_plan(write_plan, "bad_models:raises")
    for command in (["validate", "--plan", plan, "--world-size", "1"],
                    ["suggest", plan]):
        proc = tpplan_cli(*command, env={"PYTHONPATH": f"{PLANS.parent}:{PLANS.parent / 'tests'}"},
                          timeout=120)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert f"{plan}:{where}: error: model.factory 'bad_models:raises' raised ValueError" \
            in proc.stderr


@pytest.mark.parametrize("setting, message", [
    ("dim=0", "'model.kwargs.dim' must be a positive integer, got 0"),
    ("n_heads=0", "'model.kwargs.n_heads' must be a positive integer, got 0"),
    ("n_layers=-2", "'model.kwargs.n_layers' must be a positive integer, got -2"),
    ("vocab_size=0", "'model.kwargs.vocab_size' must be a positive integer, got 0"),
    ("max_seq_len=-1", "'model.kwargs.max_seq_len' must be a positive integer, got -1"),
    ("dim=64.5", "'model.kwargs.dim' must be a positive integer, got 64.5"),
    ("norm_eps=.nan", "'model.kwargs.norm_eps' must be a positive number, got nan"),
    ("n_kv_heads=3", "llama3: n_heads=8 is not a multiple of n_kv_heads=3"),
    ("dim=40", "llama3: head_dim = dim // n_heads = 40 // 8 = 5, which must be even"),
    ("n_layer=2", "unknown key 'n_layer' in 'model.kwargs' for llama3 (did you mean "
                  "'n_layers'?)"),
])
def test_llama_sizes_out_of_range_are_located_at_the_kwarg(capsys, setting, message):
    key = setting.partition("=")[0]
    rc, errors = validate(capsys, LLAMA, f"model.kwargs.{setting}")
    assert rc == 1 and len(errors) == 1, errors
    assert errors[0].startswith(f"--set model.kwargs.{setting}:1:{len(key) + 15}: error: "
                                f"{message}")


def test_llama_size_in_the_plan_file_is_located_at_its_line(capsys, write_plan):
    plan = write_plan("mesh: {tp: 1}\nmodel:\n  name: llama3\n  kwargs: {dim: 64, n_heads: 0}\n")
    rc, errors = validate(capsys, plan, world=1)
    assert rc == 1
    assert errors == [f"{plan}:4:30: error: 'model.kwargs.n_heads' must be a positive integer, "
                      "got 0"]


def test_hf_sizes_out_of_range_are_located(capsys):
    pytest.importorskip("transformers")
    rc, errors = validate(capsys, PLANS / "hf-llama.yaml", "model.config.num_attention_heads=0")
    assert rc == 1
    assert errors == ["--set model.config.num_attention_heads=0:1:34: error: "
                      "'model.config.num_attention_heads' must be at least 1, got 0"]


@pytest.mark.parametrize("setting, column, message", [
    ("fsdp.units=[layers]", 13, "FSDP unit pattern 'layers' matches 'layers', a ModuleList with "
                                "no forward of its own (its parent calls each child), so FSDP2 "
                                "cannot shard it; write 'layers.*' for each child"),
    ("fsdp.units=[tok_embeddings, [layers, norm]]", 29, "FSDP unit pattern 'layers' matches"),
    ("activation_checkpointing={mode: full, blocks: layers}", 26,
     "activation checkpointing blocks 'layers' matches 'layers', a ModuleList with no forward "
     "of its own (its parent calls each child), so checkpointing it would never run; write "
     "'layers.*' for each child"),
    ("compile={enabled: true, blocks: layers}", 9,
     "compile blocks 'layers' matches 'layers', a ModuleList with no forward of its own (its "
     "parent calls each child), so compiling it would never run; write 'layers.*' for each "
     "child"),
])
def test_a_container_without_forward_is_no_unit_or_block(capsys, setting, column, message):
    rc, errors = validate(capsys, LLAMA, setting)
    assert rc == 1 and len(errors) == 1, errors
    assert errors[0].startswith(f"--set {setting}:1:{column}: error: {message}")


def test_train_refuses_a_container_unit_before_the_process_group(tmp_path):
    proc = tpplan_cli("train", "--plan", LLAMA, "--set", "mesh.tp=1", "--set",
                      "fsdp.units=[layers]", "--set", f"metrics.run_dir={tmp_path}", timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("--set fsdp.units=[layers]:1:13: error: FSDP unit pattern "
                                  "'layers' matches 'layers', a ModuleList")
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_plan_naming_no_causal_lm_class_is_located(capsys, write_plan):
    pytest.importorskip("transformers")
    plan = write_plan("mesh: {tp: 1}\nmodel: {hf: PreTrainedModel}\n")
    rc, errors = validate(capsys, plan, world=1)
    assert rc == 1
    assert errors == [f"{plan}:2:13: error: model.hf: 'PreTrainedModel' is not a concrete model "
                      "class (an abstract base without a configuration or a forward); name a "
                      "causal language model class such as 'LlamaForCausalLM'"]
