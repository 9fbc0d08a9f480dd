"""Every mistake a user can make on the command line is one clear line, never a traceback.

Most tests run ``tpplan.cli.main`` in this process (what the command prints, its exit code;
an exception escaping it would be the traceback a user sees); a few run the real command.
"""

import shutil

import pytest
from helpers import PLANS, TEST_PLANS, run_main, tpplan_cli


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "error:" in line]


@pytest.mark.parametrize("command", [
    ["validate", "--world-size", "2", "--plan"], ["verify", "--nproc", "2", "--plan"],
    ["train", "--plan"], ["suggest"]])
def test_a_missing_plan_is_one_line_naming_it(capsys, tmp_path, command):
    missing = tmp_path / "missing.yaml"
    rc, out = run_main(capsys, *command, missing)
    assert rc == 1
    assert out.strip() == f"{missing}: error: cannot read plan: No such file or directory"


def test_a_folder_for_a_plan_is_one_line(capsys, tmp_path):
    rc, out = run_main(capsys, "suggest", tmp_path)
    assert rc == 1
    assert out.strip() == f"{tmp_path}: error: cannot read plan: it is a folder, not a YAML file"


def test_extends_naming_a_folder_is_located(capsys, write_plan, tmp_path):
    (tmp_path / "base").mkdir()
    plan = write_plan("extends: base\nmodel: {name: llama3}\n")
    rc, out = run_main(capsys, "validate", "--plan", plan, "--world-size", "1")
    assert rc == 1
    assert error_lines(out) == [f"{plan}:1:10: error: 'extends' names 'base', which is a "
                                f"folder, not a plan ({tmp_path / 'base'})"]


def test_suggest_of_a_missing_file_is_no_traceback():
    proc = tpplan_cli("suggest", "missing.yaml", timeout=60)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == "missing.yaml: error: cannot read plan: No such file or directory"


def test_a_world_size_no_process_group_can_hold_is_one_line(capsys):
    rc, out = run_main(capsys, "validate", "--plan", PLANS / "llama.yaml", "--world-size", 2**40,
                       "--set", f"train.global_batch_size={2**40}")
    assert rc == 2
    assert out.strip() == ("error: --world-size 1,099,511,627,776 is more than a PyTorch process "
                           "group can hold: at most 2,147,483,647 ranks")


def test_a_world_size_beyond_this_machines_memory_is_one_line(capsys):
    from tpplan.analysis.dryrun import MAX_WORLD_SIZE, world_size_problem

    if world_size_problem(MAX_WORLD_SIZE) is None:
        pytest.skip("this machine has the ~2 TiB of memory to simulate every rank")
    rc, out = run_main(capsys, "validate", "--plan", PLANS / "llama.yaml", "--world-size",
                       MAX_WORLD_SIZE)
    assert rc == 2 and len(out.strip().splitlines()) == 1
    assert out.startswith("error: --world-size 2,147,483,647 needs about 2,048.0 GiB of memory "
                          "for the dry run's fake process group and mesh")


@pytest.mark.parametrize("command", [["suggest", PLANS / "llama.yaml"], ["import-hf", "llama"]])
def test_a_tp_degree_out_of_range_is_one_line(capsys, command):
    rc, out = run_main(capsys, *command, "--tp", 0)
    assert rc == 2 and out.strip() == "error: --tp must be at least 1, got 0"


@pytest.mark.parametrize("target, message", [
    ("PreTrainedModel", "'PreTrainedModel' is not a concrete model class (an abstract base without "
                        "a configuration or a forward); name a causal language model class such "
                        "as 'LlamaForCausalLM'"),
    ("LlamaPreTrainedModel", "'LlamaPreTrainedModel' is not a concrete model class (an abstract "
                             "base without a configuration or a forward); try 'LlamaForCausalLM'"),
    ("LlamaModel", "'LlamaModel' is not a causal language model (tpplan trains next-token "
                   "prediction: a *ForCausalLM class); try 'LlamaForCausalLM'"),
    ("LlamaConfig", "'LlamaConfig' is a configuration class, not a model class; try "
                    "'LlamaForCausalLM'"),
    ("pipeline", "'pipeline' is a function in transformers, not a model class; name a causal "
                 "language model class such as 'LlamaForCausalLM'"),
    ("GenerationMixin", "'GenerationMixin' is not a model class; name a causal language model "
                        "class such as 'LlamaForCausalLM'"),
    ("t5", "transformers has no causal language model for model type 't5' (T5Config); tpplan "
           "trains next-token prediction (a *ForCausalLM class)"),
    ("configs/llama.json", "cannot read 'configs/llama.json': No such file or directory"),
])
def test_import_hf_of_something_that_is_no_causal_lm_is_one_line(capsys, target, message):
    pytest.importorskip("transformers")
    rc, out = run_main(capsys, "import-hf", target)
    assert rc == 1 and out.strip() == f"error: {message}"


def test_import_hf_of_a_bad_config_path_is_one_line(capsys, tmp_path):
    pytest.importorskip("transformers")
    (tmp_path / "bad.json").write_text("{model_type: llama")
    (tmp_path / "empty").mkdir()
    rc, out = run_main(capsys, "import-hf", tmp_path / "bad.json")
    assert rc == 1 and out.startswith(f"error: '{tmp_path / 'bad.json'}' is not a JSON config: ")
    assert len(out.strip().splitlines()) == 1
    rc, out = run_main(capsys, "import-hf", tmp_path / "empty")
    assert rc == 1 and out.strip() == f"error: '{tmp_path / 'empty'}' is a folder without a config.json"


def test_import_hf_of_an_abstract_class_is_no_traceback():
    pytest.importorskip("transformers")
    proc = tpplan_cli("import-hf", "PreTrainedModel", timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: 'PreTrainedModel' is not a concrete model class")


def test_suggest_refuses_to_write_over_its_own_input(capsys, tmp_path, monkeypatch):
    plan = tmp_path / "p.yaml"
    shutil.copy(PLANS / "llama.yaml", plan)
    before = plan.read_bytes()
    monkeypatch.chdir(tmp_path)
    for output in ("p.yaml", tmp_path / "p.yaml", f"../{tmp_path.name}/p.yaml"):
        rc, out = run_main(capsys, "suggest", "p.yaml", "-o", output)
        assert rc == 1 and out.strip() == (f"error: refusing to write '{output}': it is the plan "
                                           "(p.yaml), which this command reads; choose another "
                                           "output")
    (tmp_path / "link.yaml").symlink_to(plan)
    rc, out = run_main(capsys, "suggest", "p.yaml", "-o", "link.yaml")
    assert rc == 1 and "refusing to write 'link.yaml'" in out
    assert plan.read_bytes() == before


def test_suggest_refuses_to_write_over_a_parent_plan_or_the_factory_source(capsys, tmp_path,
                                                                          monkeypatch):
    (tmp_path / "my_gpt.py").write_text("from toy_models import mini_gpt as build\n")
    (tmp_path / "base.yaml").write_text('model: {factory: "my_gpt:build", kwargs: {d: 32}}\n')
    (tmp_path / "child.yaml").write_text("extends: base.yaml\nmesh: {tp: 2}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    rc, out = run_main(capsys, "suggest", "child.yaml", "-o", "base.yaml")
    assert rc == 1 and out.strip().startswith("error: refusing to write 'base.yaml': it is the "
                                              f"plan ({tmp_path / 'base.yaml'})")
    rc, out = run_main(capsys, "suggest", "child.yaml", "-o", "my_gpt.py")
    assert rc == 1 and out.strip() == (f"error: refusing to write 'my_gpt.py': it is the source "
                                       f"of model.factory ({tmp_path / 'my_gpt.py'}), which this "
                                       "command reads; choose another output")
    assert (tmp_path / "base.yaml").read_text().startswith("model: {factory")
    rc, out = run_main(capsys, "suggest", "child.yaml", "-o", "out.yaml")
    assert rc == 0 and (tmp_path / "out.yaml").is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "__pycache__") == [
        "base.yaml", "child.yaml", "my_gpt.py", "out.yaml"]  # no temp file left


def test_import_hf_refuses_to_write_over_its_config(capsys, tmp_path):
    pytest.importorskip("transformers")
    config = tmp_path / "config.json"
    shutil.copy(TEST_PLANS / "hf" / "llama-config.json", config)
    before = config.read_bytes()
    for target in (config, tmp_path):
        rc, out = run_main(capsys, "import-hf", target, "-o", config)
        assert rc == 1 and out.strip() == (f"error: refusing to write '{config}': it is the "
                                           f"imported config ({config}), which this command "
                                           "reads; choose another output")
    assert config.read_bytes() == before


def test_an_output_in_a_missing_folder_or_on_a_folder_is_one_line(capsys, tmp_path):
    plan = PLANS / "llama.yaml"
    rc, out = run_main(capsys, "suggest", plan, "-o", tmp_path / "no" / "p.yaml")
    assert rc == 1 and out.strip() == (f"error: cannot write '{tmp_path / 'no' / 'p.yaml'}': "
                                       f"there is no folder '{tmp_path / 'no'}'")
    rc, out = run_main(capsys, "suggest", plan, "-o", tmp_path)
    assert rc == 1 and out.strip() == f"error: cannot write '{tmp_path}': it is a folder"


def test_a_write_that_fails_leaves_the_previous_file_and_no_temp(tmp_path):
    from tpplan.byom.outputs import atomic_output

    target = tmp_path / "plan.yaml"
    target.write_text("previous\n")
    with pytest.raises(RuntimeError):
        with atomic_output(target) as tmp:
            tmp.write_text("half of a pl")
            raise RuntimeError("disk full, say")
    assert target.read_text() == "previous\n"
    assert [p.name for p in tmp_path.iterdir()] == ["plan.yaml"]
