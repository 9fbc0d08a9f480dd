"""Writing what ``suggest``, ``import-hf`` and ``export`` produce: atomically, and never over
one of the files the command read.

A file is written next to its destination under a temporary name and renamed over it
(``os.replace``), so a failure (a full disk, an error half-way) leaves the previous file or
none, never half of one. Before anything is written, the destination is compared with every
input (the plan or model file, its ``extends`` chain, the ``hf_config`` it names, the
factory's source): writing over one of them is refused with one line.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator

from ..models.hf import hf_config_path
from ..plan.errors import CommandError
from ..plan.specs import ModelSpec
from ..plan.yamlio import LMap, LSeq

__all__ = ["atomic_output", "model_inputs", "plan_files", "refuse_inputs", "write_text"]

Input = tuple[str, Path]  # what it is, in the user's words; its path


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet): compare where they would be
        return a.resolve() == b.resolve()


def refuse_inputs(output: str | Path, inputs: Iterable[Input]) -> None:
    """:class:`CommandError` if ``output`` is one of ``inputs`` (same file, any spelling)."""
    for label, path in inputs:
        if _same(Path(output), Path(path)):
            raise CommandError(f"refusing to write '{output}': it is {label} ({path}), which this "
                               "command reads; choose another output")


@contextlib.contextmanager
def atomic_output(path: str | Path, inputs: Iterable[Input] = ()) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; renamed over ``path`` when the block
    ends without an error, removed otherwise. Problems writing are :class:`CommandError`."""
    path = Path(path)
    refuse_inputs(path, inputs)
    if path.is_dir():
        raise CommandError(f"cannot write '{path}': it is a folder")
    if not path.parent.is_dir():
        raise CommandError(f"cannot write '{path}': there is no folder '{path.parent}'")
    try:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise CommandError(f"cannot write '{path}': {e.strerror}") from None
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as open() would create it, not mkstemp's 0600
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise CommandError(f"cannot write '{path}': {e.strerror or e}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path: str | Path, text: str, inputs: Iterable[Input] = ()) -> None:
    """``text`` into ``path``, atomically, unless ``path`` is one of ``inputs``."""
    with atomic_output(path, inputs) as tmp:
        tmp.write_text(text)


def plan_files(doc: Any) -> set[str]:
    """Every file a located plan document was read from: the plan and its ``extends``."""
    files: set[str] = set()
    stack = [doc]
    while stack:
        node = stack.pop()
        if isinstance(node, LMap):
            files.update(loc.file for loc in (node.loc, *node.key_locs.values()))
            stack.extend(node.values())
        elif isinstance(node, LSeq):
            files.add(node.loc.file)
            stack.extend(node)
    return {f for f in files if not f.startswith(("--set ", "<")) and Path(f).is_file()}


def model_inputs(doc: Any, spec: ModelSpec | None) -> list[Input]:
    """The files a command that builds the plan's model has read: the plan files, the
    ``hf_config`` and the factory's source module."""
    inputs: list[Input] = [("the plan", Path(f)) for f in sorted(plan_files(doc))]
    if spec is not None and spec.hf_config:
        inputs.append(("the model's hf_config", hf_config_path(spec)))
    if spec is not None and spec.factory:
        module = spec.factory.partition(":")[0]
        try:
            found = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            found = None
        if found is not None and found.origin and Path(found.origin).is_file():
            inputs.append(("the source of model.factory", Path(found.origin)))
    return inputs
