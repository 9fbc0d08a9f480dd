"""YAML with locations, read with the safe loader only.

PyYAML's ``safe_load`` forgets where a value came from and silently keeps the last of two
duplicate keys. tpplan composes the node graph (safe: no object is constructed from tags),
then walks it into plain dicts, lists and scalars that remember their line and column.
The walk has a budget, so an alias bomb ("billion laughs") is refused instead of
expanded into all of memory.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any

import yaml

from .errors import Loc, PlanError

__all__ = ["LMap", "LSeq", "load_file", "load_text", "not_a_file", "plain", "MAX_BYTES",
           "MAX_NODES"]

MAX_BYTES = 1 << 20  # a plan is a page of text; a megabyte is already absurd
MAX_NODES = 100_000  # values after alias expansion
MAX_DEPTH = 64
SAFE_TAGS = {f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null", "seq", "map")}


class _Loader(yaml.SafeLoader):
    """The safe loader, reading ``1e-05`` as a float as YAML 1.2 and JSON do (YAML 1.1 wants a
    dot, ``1.0e-05``, and reads the other as a string: an ``rms_norm_eps`` set that way would
    reach a config as text)."""


_Loader.add_implicit_resolver("tag:yaml.org,2002:float",
                              re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"),
                              list("-+0123456789"))


class LMap(dict):
    """A mapping that remembers where it, each key and each value stand in the file."""

    def __init__(self, loc: Loc):
        super().__init__()
        self.loc = loc
        self.key_locs: dict[Any, Loc] = {}
        self.value_locs: dict[Any, Loc] = {}

    def key_loc(self, key: Any) -> Loc:
        return self.key_locs.get(key, self.loc)

    def value_loc(self, key: Any) -> Loc:
        return self.value_locs.get(key, self.key_loc(key))

    def put(self, key: Any, value: Any, key_loc: Loc, value_loc: Loc) -> None:
        self[key] = value
        self.key_locs[key] = key_loc
        self.value_locs[key] = value_loc


class LSeq(list):
    """A list that remembers where it and each item stand in the file."""

    def __init__(self, loc: Loc):
        super().__init__()
        self.loc = loc
        self.item_locs: list[Loc] = []

    def item_loc(self, index: int) -> Loc:
        return self.item_locs[index] if index < len(self.item_locs) else self.loc

    def push(self, value: Any, loc: Loc) -> None:
        self.append(value)
        self.item_locs.append(loc)


def plain(value: Any) -> Any:
    """Located values back to plain dicts and lists (for writing a plan out)."""
    if isinstance(value, LMap):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, LSeq):
        return [plain(v) for v in value]
    return value


def _mark(file: str, mark: Any) -> Loc:
    return Loc(file, mark.line + 1, mark.column + 1)


class _Walker:
    def __init__(self, file: str):
        self.file = file
        self.count = 0
        self.scalars = yaml.constructor.SafeConstructor()

    def walk(self, node: yaml.Node, depth: int = 0) -> Any:
        loc = _mark(self.file, node.start_mark)
        self.count += 1
        if self.count > MAX_NODES:
            raise PlanError(
                f"the plan expands to more than {MAX_NODES} values (an alias bomb?); refused",
                loc,
            )
        if depth > MAX_DEPTH:
            raise PlanError(f"the plan nests deeper than {MAX_DEPTH} levels (a recursive alias?)", loc)
        if node.tag not in SAFE_TAGS:
            raise PlanError(f"YAML tag '{node.tag}' is not allowed in a plan; plans hold plain "
                            "mappings, lists, strings, numbers, booleans and null", loc)
        if isinstance(node, yaml.ScalarNode):
            if node.tag.endswith(":int") and ":" in node.value:
                # YAML 1.1 reads 3:4 as a base-60 integer (184); as in YAML 1.2 it stays
                # text here (``metrics.profile: 3:4`` means steps 3 to 4).
                return node.value
            return self.scalars.construct_object(node)
        if isinstance(node, yaml.SequenceNode):
            seq = LSeq(loc)
            for item in node.value:
                seq.push(self.walk(item, depth + 1), _mark(self.file, item.start_mark))
            return seq
        if isinstance(node, yaml.MappingNode):
            out = LMap(loc)
            for key_node, value_node in node.value:
                key_loc = _mark(self.file, key_node.start_mark)
                if key_node.tag == "tag:yaml.org,2002:merge":
                    raise PlanError("YAML merge keys ('<<') are not supported; use 'extends:'", key_loc)
                key = self.walk(key_node, depth + 1)
                if isinstance(key, (LMap, LSeq)):
                    raise PlanError("a mapping key must be a plain value", key_loc)
                if key in out:
                    first = out.key_loc(key)
                    raise PlanError(
                        f"duplicate key '{key}' (first defined at line {first.line}); "
                        "YAML would silently keep only the last one",
                        key_loc,
                    )
                value = self.walk(value_node, depth + 1)
                out.put(key, value, key_loc, _mark(self.file, value_node.start_mark))
            return out
        raise PlanError(f"unsupported YAML node {type(node).__name__}", loc)


def load_text(text: str, file: str = "<plan>") -> Any:
    """Parse YAML text into located values; raises :class:`PlanError` with the place."""
    if len(text.encode("utf-8", errors="replace")) > MAX_BYTES:
        raise PlanError(f"the file is larger than {MAX_BYTES} bytes; a plan is refused above that",
                        Loc(file, 1, 1))
    try:
        node = yaml.compose(text, Loader=_Loader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        loc = _mark(file, mark) if mark is not None else Loc(file, 1, 1)
        what = " ".join(x for x in (e.context, e.problem) if x)
        raise PlanError(f"YAML syntax error: {what}", loc) from None
    except yaml.YAMLError as e:
        raise PlanError(f"YAML error: {e}", Loc(file, 1, 1)) from None
    if node is None:
        return LMap(Loc(file, 1, 1))
    return _Walker(file).walk(node)


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
          (stat.S_ISSOCK, "a socket"))


def not_a_file(mode: int) -> str | None:
    """What a path whose ``os.stat`` mode is ``mode`` is when it is no regular file ("a
    folder", "a character device", "a named pipe (FIFO)", ...); None for a regular file.

    An input tpplan reads (a plan, a config.json, a data file) must be a regular file: a
    device such as /dev/zero never ends, a FIFO or a terminal (/dev/stdin) blocks until
    someone writes, and every rank of a run reads the plan again, which a pipe cannot
    give twice."""
    return next((kind for test, kind in _KINDS if test(mode)), None if stat.S_ISREG(mode)
                else "not a regular file")


def load_file(path: str | Path) -> Any:
    """Read and parse a YAML file into located values."""
    p = Path(path)
    try:
        st = os.stat(p)
    except OSError as e:
        raise PlanError(f"cannot read plan: {e.strerror}", Loc(str(path), 0, 0)) from None
    kind = not_a_file(st.st_mode)
    if kind:
        raise PlanError(f"cannot read plan: it is {kind}, not a YAML file"
                        + ("" if kind == "a folder" else " (a plan is read again by every rank: "
                           "save it to a file)"), Loc(str(path), 0, 0))
    if st.st_size > MAX_BYTES:
        raise PlanError(f"the file is {st.st_size} bytes; a plan is refused above {MAX_BYTES}",
                        Loc(str(path), 1, 1))
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise PlanError(f"cannot read plan: {e.strerror}", Loc(str(path), 0, 0)) from None
    except UnicodeDecodeError as e:
        raise PlanError(f"cannot read plan: not UTF-8 text (byte {e.object[e.start]:#04x} at "
                        f"offset {e.start})", Loc(str(path), 0, 0)) from None
    return load_text(text, str(path))
