"""Every mistake a user can make on the command line is one clear line, never a traceback.

Most tests run ``tpplan.cli.main`` in this process (what the command prints, its exit code;
an exception escaping it would be the traceback a user sees); a few run the real command.
"""

import pytest
from helpers import PLANS, run_main, tpplan_cli  # noqa: F401


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
