"""The layout keeps the architecture of docs/architecture.md: imports only point down.

plan -> models | parallel | checkpoint -> api -> analysis | train | byom -> commands -> cli
-> __main__.
Layers on one level do not import each other. Read from every module's AST, so a lazy
import inside a function counts as much as one at the top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from helpers import ROOT

PACKAGE = ROOT / "tpplan"
# layer -> level; a module may import its own layer and any layer of a lower level.
LEVELS = {
    "plan": 0, "exports": 0, "_torch": 0,
    "models": 1, "parallel": 1, "checkpoint": 1,
    "api": 2,
    "analysis": 3, "train": 3, "byom": 3,
    "commands": 4,
    "cli": 5,
    "__main__": 6,
}
# Modules allowed past ~300 lines, each with its reason (none needs one today).
LONG: dict[str, str] = {}
MAX_LINES = 300


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py"))


def _layer(module: str) -> str:
    """``tpplan.plan.specs`` -> ``plan``; the package root is the façade's level."""
    parts = module.split(".")
    return "api" if len(parts) == 1 else parts[1]


def _name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, name: str) -> list[tuple[int, str]]:
    """Every tpplan module that module ``name`` (its source at ``path``) imports, with its line."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "tpplan"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "tpplan":
                continue
            # "from .. import checkpoint" names a subpackage, not an attribute of the root
            out += [(node.lineno, f"{target}.{a.name}" if target == "tpplan" and
                     (PACKAGE / a.name).is_dir() else target) for a in node.names]
    return out


def violations(path: Path, name: str) -> list[str]:
    here = _layer(name)
    wrong = []
    for line, target in _imports(path, name):
        there = _layer(target)
        if there != here and LEVELS[there] >= LEVELS[here]:
            wrong.append(f"{name}:{line}: {here} imports {target} "
                         f"({'across' if LEVELS[there] == LEVELS[here] else 'up'})")
    return wrong


def test_every_module_belongs_to_a_layer():
    unknown = {_layer(_name(p)) for p in _modules()} - set(LEVELS)
    assert not unknown, f"modules outside the documented layers: {unknown}"


def test_imports_point_down_only():
    wrong = [v for path in _modules() for v in violations(path, _name(path))]
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_lazy_upward_and_sideways_imports(tmp_path):
    source = tmp_path / "bad.py"
    source.write_text("import torch\nfrom .specs import PlanSpec\n\n\ndef f():\n"
                      "    from ..parallel.apply import apply_plan\n"
                      "    from tpplan.analysis import ANALYSES\n")
    assert violations(source, "tpplan.plan.bad") == [
        "tpplan.plan.bad:6: plan imports tpplan.parallel.apply (up)",
        "tpplan.plan.bad:7: plan imports tpplan.analysis (up)"]
    assert violations(source, "tpplan.train.bad") == [
        "tpplan.train.bad:7: train imports tpplan.analysis (across)"]


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_is_long_without_a_reason(path):
    rel = str(path.relative_to(PACKAGE))
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES or rel in LONG, f"{rel}: {lines} lines"


def test_tests_use_no_private_name_of_the_product():
    private = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tpplan"):
                private += [f"{path.name}:{node.lineno}: {node.module}.{a.name}"
                            for a in node.names if a.name.startswith("_")]
                if any(part.startswith("_") for part in node.module.split(".")):
                    private.append(f"{path.name}:{node.lineno}: {node.module}")
    assert not private, "\n".join(private)
