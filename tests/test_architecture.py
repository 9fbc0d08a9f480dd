"""The layout keeps the architecture of docs/architecture.md: imports only point down.

plan -> models | parallel | checkpoint -> api | data -> analysis | train | byom -> commands -> cli
-> __main__.
Layers on one level do not import each other. Read from every module's AST, so a lazy
import inside a function counts as much as one at the top.
"""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import ROOT

PACKAGE = ROOT / "tpplan"
# layer -> level; a module may import its own layer and any layer of a lower level.
LEVELS = {
    "plan": 0, "exports": 0, "_torch": 0,
    "models": 1, "parallel": 1, "checkpoint": 1, "ft": 1,
    "api": 2, "data": 2,
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


def _import_target(node: ast.ImportFrom, package: str) -> str:
    """The absolute module a ``from ... import`` in ``package`` reads from."""
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(path: Path, name: str) -> list[tuple[int, str]]:
    """Every tpplan module that module ``name`` (its source at ``path``) imports, with its line."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "tpplan"]
        elif isinstance(node, ast.ImportFrom):
            target = _import_target(node, package)
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


def test_no_module_is_long_without_a_reason():
    long = []
    for path in _modules():
        rel = str(path.relative_to(PACKAGE))
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES and rel not in LONG:
            long.append(f"{rel}: {lines} lines")
    assert not long, "\n".join(long)


# The tests that import tpplan._torch (the door to PyTorch's internals), each with its reason.
DOOR_TESTS = {
    "test_torch_door.py": "checks each door entry's torch names on the installed torch",
    "test_module_swap.py": "tests the door's parameter/child swap (tpplan/_torch/modules.py) directly",
}


def test_tests_use_no_private_name_of_the_product():
    private = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tpplan"):
                private += [f"{path.name}:{node.lineno}: {node.module}.{a.name}"
                            for a in node.names if a.name.startswith("_")]
                # the door's own tests may import it: a private path of public names
                door = node.module.split(".")[:2] == ["tpplan", "_torch"] and path.name in DOOR_TESTS
                if not door and any(part.startswith("_") for part in node.module.split(".")):
                    private.append(f"{path.name}:{node.lineno}: {node.module}")
    assert not private, "\n".join(private)


MAX_FUNCTION_LINES = 80
LONG_BECAUSE = "Long because:"


def long_functions(source: str, name: str) -> list[str]:
    """Every function or method over MAX_FUNCTION_LINES lines (``def`` to its last line,
    decorators excluded) whose docstring has no paragraph starting ``Long because:``."""
    long = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        lines = node.end_lineno - node.lineno + 1
        paragraphs = (ast.get_docstring(node) or "").split("\n\n")
        if lines > MAX_FUNCTION_LINES and not any(p.strip().startswith(LONG_BECAUSE) for p in paragraphs):
            long.append(f"{name}:{node.lineno}: {node.name} is {lines} lines")
    return long


def _is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


def private_imports(source: str, name: str, package: str) -> list[str]:
    """Every private name of another tpplan module that module ``name`` (in ``package``)
    imports: ``from .x import _y``, ``from tpplan.x import _y``, or ``x._y`` on an imported
    tpplan module. A private module path (``tpplan._torch.x``) is no private name."""
    tree = ast.parse(source)
    modules: dict[str, str] = {}
    wrong = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update({a.asname: a.name for a in node.names if a.asname and a.name.startswith("tpplan.")})
        elif isinstance(node, ast.ImportFrom):
            target = _import_target(node, package)
            if target.split(".")[0] != "tpplan":
                continue
            wrong += [f"{name}:{node.lineno}: imports {target}.{a.name}" for a in node.names if _private(a.name)]
            modules.update({a.asname or a.name: f"{target}.{a.name}" for a in node.names
                            if _is_module(f"{target}.{a.name}")})
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in modules and _private(node.attr)):
            wrong.append(f"{name}:{node.lineno}: uses {modules[node.value.id]}.{node.attr}")
    return sorted(wrong, key=lambda w: int(w.split(":")[1]))


def _lazy_exports_form(node: ast.Assign) -> bool:
    """``__all__, __getattr__ = lazy_exports(__name__, {...})``, the form of tpplan/exports.py."""
    names = node.targets[0].elts if isinstance(node.targets[0], ast.Tuple) else []
    return ([getattr(n, "id", None) for n in names] == ["__all__", "__getattr__"]
            and isinstance(node.value, ast.Call) and getattr(node.value.func, "id", None) == "lazy_exports")


def _plain_dunder(node: ast.Assign) -> bool:
    """``__all__ = [...]`` or ``__version__ = "..."``: a literal, no logic."""
    if len(node.targets) != 1 or not isinstance(node.targets[0], ast.Name):
        return False
    try:
        ast.literal_eval(node.value)
    except ValueError:
        return False
    return node.targets[0].id in ("__all__", "__version__")


def init_logic(source: str, name: str) -> list[str]:
    """What a package ``__init__`` holds beyond re-exporting: anything but its docstring,
    imports, a literal ``__all__``/``__version__`` and the ``lazy_exports`` form."""
    wrong = []
    for i, node in enumerate(ast.parse(source).body):
        if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Assign) and (_lazy_exports_form(node) or _plain_dunder(node)):
            continue
        wrong.append(f"{name}:{node.lineno}: {type(node).__name__} in a package __init__")
    return wrong


def _sources() -> list[tuple[str, str, str]]:
    """(source, module name, its package) of every module of tpplan/."""
    out = []
    for path in _modules():
        name = _name(path)
        out.append((path.read_text(), name, name if path.name == "__init__.py" else name.rpartition(".")[0]))
    return out


def test_the_function_check_sees_a_long_function_and_reads_its_reason():
    body = "".join(f"    x = {i}\n" for i in range(80))
    method = "".join(f"        x = {i}\n" for i in range(79))
    source = f"@decorated\ndef long():\n{body}\n\nclass C:\n    def fits(self):\n{method}"
    assert long_functions(source, "tpplan.bad") == ["tpplan.bad:2: long is 81 lines"]
    reason = '    """Does one thing.\n\n    Long because: one table, read top to bottom."""\n'
    assert long_functions(f"def long():\n{reason}{body}", "tpplan.bad") == []
    assert long_functions(f'def long():\n    """Long because it is."""\n{body}', "tpplan.bad") == [
        "tpplan.bad:1: long is 82 lines"]


def test_no_function_is_long_without_a_reason():
    long = [v for source, name, _ in _sources() for v in long_functions(source, name)]
    assert not long, "\n".join(long)


def test_the_private_import_check_sees_each_form():
    source = ("from .adapters import _style_of, apply_lora\nfrom tpplan.analysis.analyses import _accumulation\n"
              "from ...plan import styles\nimport tpplan.plan.specs as specs\nfrom tpplan._torch import fsdp\n"
              "from os import _exit\n\n\ndef f():\n"
              "    return styles._table, specs._parse, styles.__name__, fsdp.chunk\n")
    assert private_imports(source, "tpplan.parallel.lora.sizes", "tpplan.parallel.lora") == [
        "tpplan.parallel.lora.sizes:1: imports tpplan.parallel.lora.adapters._style_of",
        "tpplan.parallel.lora.sizes:2: imports tpplan.analysis.analyses._accumulation",
        "tpplan.parallel.lora.sizes:10: uses tpplan.plan.styles._table",
        "tpplan.parallel.lora.sizes:10: uses tpplan.plan.specs._parse"]


def test_no_module_imports_another_modules_private_name():
    wrong = [v for source, name, package in _sources() for v in private_imports(source, name, package)]
    assert not wrong, "\n".join(wrong)


def test_the_init_check_sees_logic():
    source = ('"""Doc."""\n\nfrom __future__ import annotations\n\nfrom .a import b\n\n__all__ = ["b"]\n'
              '__version__ = "1"\n__all__, __getattr__ = lazy_exports(__name__, {"a": ["b"]})\n\n\n'
              'def read(path):\n    return b(path)\n\n\nCACHE = {}\n')
    assert init_logic(source, "tpplan.plan") == [
        "tpplan.plan:12: FunctionDef in a package __init__", "tpplan.plan:16: Assign in a package __init__"]


def test_package_inits_only_re_export():
    wrong = [v for source, name, package in _sources() if name == package for v in init_logic(source, name)]
    assert not wrong, "\n".join(wrong)


def test_git_ignores_no_file_of_the_project():
    """A pattern in .gitignore once matched a package (``runs/`` hid tpplan/analysis/runs/'s
    ``__init__``): a fresh clone then lacks the file and nothing local says so."""
    import shutil
    import subprocess

    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return  # a source tree without git (an sdist) ignores nothing
    listed = subprocess.run(["git", "ls-files", "--others", "--ignored", "--exclude-standard", "--",
                             "tpplan", "tests", "scripts", "plans", "docs"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.split()
    ignored = [p for p in listed if "__pycache__" not in p and not p.endswith(".pyc")]
    assert not ignored, f"git ignores these files of the project: {ignored}"


def test_a_rank_does_not_import_the_compiler_until_it_compiles():
    """torch._dynamo takes about a second to import, paid by every rank of every launch; a
    module-level ``@torch.compiler.disable`` in the Llama's import chain once did it."""
    import subprocess
    import sys

    code = ("import sys, tpplan.commands.train, tpplan.train.loop, tpplan.parallel.apply, "
            "tpplan.analysis.dryrun; print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    assert out == "False"


# The door to PyTorch's internals (tpplan/_torch/, see its __init__): outside it no module
# uses a private torch or transformers name, writes a private attribute on their objects,
# or patches them. A private name is one tpplan does not define itself (a method or class
# attribute of its own classes, an attribute it sets on ``self``, or a ``_tpplan_`` one).
FOREIGN = ("torch", "transformers")
# Private names of torch used outside the door, each with its reason.
OUTSIDE_THE_DOOR = {
    "_apply": "ParallelStyle's one contract method (abstract in torch.distributed.tensor.parallel"
              ".style): every custom style defines it and calls its parts' (test_torch_door checks it)",
    "_partition_linear_fn": "ColwiseParallel's per-module hook its _apply calls: how a colwise style "
                            "shards a packed weight (test_torch_door checks it)",
}


def _foreign_names(tree: ast.AST) -> tuple[dict[str, str], set[str]]:
    """(names a module binds to torch/transformers objects -> their dotted origin, names it
    binds to other absolute imports). An ``importlib.import_module("torch...")`` or
    ``sys.modules.get("transformers...")`` binding counts as an import."""
    foreign: dict[str, str] = {}
    other: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                bound = a.asname or a.name.split(".")[0]
                if a.name.split(".")[0] in FOREIGN:
                    foreign[bound] = a.name if a.asname else bound
                else:
                    other.add(bound)
        elif isinstance(n, ast.ImportFrom) and not n.level:
            for a in n.names:
                if (n.module or "").split(".")[0] in FOREIGN:
                    foreign[a.asname or a.name] = f"{n.module}.{a.name}"
                else:
                    other.add(a.asname or a.name)
        elif isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and n.value.args and \
                isinstance(n.value.args[0], ast.Constant) and str(n.value.args[0].value).split(".")[0] in FOREIGN:
            foreign.update({t.id: n.value.args[0].value for t in n.targets if isinstance(t, ast.Name)})
    return foreign, other


def _resolve(dotted: str):
    """The object a dotted torch/transformers path names, or None."""
    import importlib

    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            obj = getattr(obj, part, None)
        return obj
    return None


def _root(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _overrides(tree: ast.AST, foreign: dict[str, str]) -> list[ast.FunctionDef]:
    """Methods of classes with a torch/transformers base that define a private name the base has."""
    out = []
    for c in ast.walk(tree):
        if not isinstance(c, ast.ClassDef):
            continue
        bases = [_resolve(foreign[_root(b)] + ast.unparse(b)[len(_root(b)):]) for b in c.bases
                 if isinstance(b, (ast.Name, ast.Attribute)) and _root(b) in foreign]
        out += [d for d in c.body if isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(d.name)
                and any(b is not None and hasattr(b, d.name) for b in bases)]
    return out


def own_private_names(source: str) -> set[str]:
    """The private names a module defines for its own objects: its classes' methods (not
    overrides of a torch base's) and class attributes, and attributes set on ``self``/``cls``."""
    tree = ast.parse(source)
    overrides = set(map(id, _overrides(tree, _foreign_names(tree)[0])))
    own = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.ClassDef):
            for d in n.body:
                if isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef)) and id(d) not in overrides:
                    own.add(d.name)
                elif isinstance(d, (ast.Assign, ast.AnnAssign)):
                    own |= {t.id for t in (d.targets if isinstance(d, ast.Assign) else [d.target])
                            if isinstance(t, ast.Name)}
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name) \
                and n.value.id in ("self", "cls"):
            own.add(n.attr)
    return {o for o in own if _private(o)}


def torch_internals(source: str, name: str, own: set[str]) -> list[str]:
    """Each use of torch's (or transformers') internals in module ``name``: (a) a private name
    imported or read, (b) a private attribute written, (c) a patch (an attribute of an
    imported torch/transformers module or class assigned, or set with ``setattr``)."""
    tree = ast.parse(source)
    foreign, other = _foreign_names(tree)
    mine = own | set(OUTSIDE_THE_DOOR)
    found = [(d.lineno, f"private name: def {d.name} overrides torch's") for d in _overrides(tree, foreign)
             if d.name not in OUTSIDE_THE_DOOR]

    def private(attr: str) -> bool:
        return _private(attr) and attr not in mine and not attr.startswith("_tpplan")

    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and not n.level and (n.module or "").split(".")[0] in FOREIGN:
            if any(_private(p) for p in n.module.split(".")) or any(_private(a.name) for a in n.names):
                found.append((n.lineno, f"private name: from {n.module} import "
                              + ", ".join(a.name for a in n.names)))
        elif isinstance(n, ast.Import):
            found += [(n.lineno, f"private name: import {a.name}") for a in n.names
                      if a.name.split(".")[0] in FOREIGN and any(_private(p) for p in a.name.split("."))]
        elif isinstance(n, ast.Attribute):
            root, store = _root(n), isinstance(n.ctx, (ast.Store, ast.Del))
            if store and root in foreign:
                found.append((n.lineno, f"patch: {ast.unparse(n)}"))
            elif root not in other and (private(n.attr) or root in foreign and _private(n.attr)):
                found.append((n.lineno, f"{'private write' if store else 'private name'}: {ast.unparse(n)}"))
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and len(n.args) > 1 and \
                n.func.id in ("setattr", "getattr", "hasattr", "delattr"):
            attr = n.args[1].value if isinstance(n.args[1], ast.Constant) else None
            if n.func.id in ("setattr", "delattr") and _root(n.args[0]) in foreign:
                found.append((n.lineno, f"patch: {ast.unparse(n)}"))
            elif isinstance(attr, str) and private(attr):
                found.append((n.lineno, f"{'private write' if n.func.id == 'setattr' else 'private name'}: "
                              f"{ast.unparse(n)}"))
    return [f"{name}:{line}: {what}" for line, what in sorted(set(found))]


def test_the_door_check_sees_private_names_writes_and_patches():
    source = ("import os\nimport sys\nimport torch\nimport torch.nn.functional as F\n"
              "from torch.utils._pytree import tree_flatten\nfrom torch.distributed import _functional_collectives\n"
              "from torch.distributed.tensor import DTensor\n"
              "from torch.utils._python_dispatch import TorchDispatchMode\n"
              "\n\nclass Mode(TorchDispatchMode):\n    @classmethod\n    def _should_skip_dynamo(cls):\n"
              "        return False\n\n    def _mine(self):\n        self._seen = 1\n\n\n"
              "def f(func, config, optimizer):\n    masking = sys.modules.get('transformers.masking_utils')\n"
              "    F.scaled_dot_product_attention = f\n    setattr(torch.nn.Module, 'register_parameter', f)\n"
              "    masking.is_tracing = f\n    config._attn_implementation = 'x'\n"
              "    optimizer._init_group({}, [], [])\n    torch._C._len_torch_dispatch_stack()\n"
              "    DTensor._op_dispatcher.x = 1\n    getattr(func, '_schema')\n    os._exit(0)\n"
              "    Mode()._mine(), func._seen, func._tpplan_ep, func._apply(1, 2)\n")
    own = own_private_names(source)
    assert own == {"_mine", "_seen"}
    assert torch_internals(source, "tpplan.analysis.bad", own) == [
        "tpplan.analysis.bad:5: private name: from torch.utils._pytree import tree_flatten",
        "tpplan.analysis.bad:6: private name: from torch.distributed import _functional_collectives",
        "tpplan.analysis.bad:8: private name: from torch.utils._python_dispatch import TorchDispatchMode",
        "tpplan.analysis.bad:13: private name: def _should_skip_dynamo overrides torch's",
        "tpplan.analysis.bad:22: patch: F.scaled_dot_product_attention",
        "tpplan.analysis.bad:23: patch: setattr(torch.nn.Module, 'register_parameter', f)",
        "tpplan.analysis.bad:24: patch: masking.is_tracing",
        "tpplan.analysis.bad:25: private write: config._attn_implementation",
        "tpplan.analysis.bad:26: private name: optimizer._init_group",
        "tpplan.analysis.bad:27: private name: torch._C",
        "tpplan.analysis.bad:27: private name: torch._C._len_torch_dispatch_stack",
        "tpplan.analysis.bad:28: patch: DTensor._op_dispatcher.x",
        "tpplan.analysis.bad:28: private name: DTensor._op_dispatcher",
        "tpplan.analysis.bad:29: private name: getattr(func, '_schema')"]


def test_torch_internals_only_behind_the_door():
    sources = [(source, name) for source, name, _ in _sources() if _layer(name) != "_torch"]
    own = set().union(*(own_private_names(source) for source, _ in sources))
    wrong = [v for source, name in sources for v in torch_internals(source, name, own)]
    assert not wrong, "\n".join(wrong)


def test_the_product_reads_no_test_hook():
    """Test hooks live in tests/hooked.py, which replaces public product functions for a
    test's processes: no product module reads a test's environment variable."""
    hooks = [f"{p.relative_to(ROOT)}:{i}" for p in _modules()
             for i, line in enumerate(p.read_text().splitlines(), 1) if "TPPLAN_TEST" in line]
    assert not hooks, "\n".join(hooks)
