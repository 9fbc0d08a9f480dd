"""Reading a plan document: ``extends`` chains and ``--set`` overrides, locations kept.

A child plan overrides its parent key by key, recursively for mappings; lists and scalars
replace. Rules under ``tensor_parallel`` replace whole (a child's ``wo: colwise`` does not
inherit the parent's ``output_layouts``). A key set to ``null`` removes what the parent set.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Sequence

from .errors import Loc, PlanError
from .yamlio import LMap, LSeq, load_file, load_text, not_a_file

__all__ = ["read_document", "apply_override", "overridden"]

MAX_EXTENDS = 16
REPLACE_WHOLE = ("tensor_parallel",)  # sections whose entries replace, never merge
# Keys that say one thing two ways: a child plan or a --set giving one of them replaces the
# other where the parent (or the file) gave it; given together in one place they must agree.
ALTERNATIVES = {"train": ("global_batch_size", "local_batch_size")}


def _given_one(keys: set[str], section: str) -> str | None:
    """The one key of ``section``'s alternatives in ``keys``, or None (neither or both)."""
    given = [k for k in ALTERNATIVES.get(section, ()) if k in keys]
    return given[0] if len(given) == 1 else None


def merge(base: LMap, child: LMap, path: tuple = ()) -> LMap:
    out = LMap(child.loc)
    one = _given_one({k for k, v in child.items() if v is not None}, path[0]) \
        if len(path) == 1 else None
    for key, value in base.items():
        if one is None or key not in ALTERNATIVES[path[0]]:
            out.put(key, value, base.key_loc(key), base.value_loc(key))
    for key, value in child.items():
        if key == "extends" and not path:
            continue
        if value is None:
            out.pop(key, None)  # null removes what the parent set
            continue
        old = out.get(key)
        replace = bool(path) and path[0] in REPLACE_WHOLE
        if isinstance(old, LMap) and isinstance(value, LMap) and not replace:
            value = merge(old, value, path + (key,))
        out.put(key, value, child.key_loc(key), child.value_loc(key))
    return out


def _read(path: Path, chain: tuple[str, ...]) -> LMap:
    doc = load_file(path)
    if not isinstance(doc, LMap):
        raise PlanError("a plan must be a YAML mapping of sections (mesh:, model:, ...)",
                        getattr(doc, "loc", None) or Loc(str(path), 1, 1))
    parent = doc.get("extends")
    if parent is None:
        return doc
    loc = doc.value_loc("extends")
    if not isinstance(parent, str):
        raise PlanError("'extends' takes the path of another plan file, relative to this one", loc)
    target = (path.parent / parent).resolve()
    if str(target) in chain:
        raise PlanError(f"'extends' forms a cycle: {' -> '.join(chain + (str(target),))}", loc)
    if len(chain) >= MAX_EXTENDS:
        raise PlanError(f"'extends' chain deeper than {MAX_EXTENDS} files", loc)
    if not target.exists():
        raise PlanError(f"'extends' names '{parent}', which does not exist ({target})", loc)
    kind = not_a_file(target.stat().st_mode)
    if kind:
        raise PlanError(f"'extends' names '{parent}', which is {kind}, not a plan ({target})", loc)
    return merge(_read(target, chain + (str(target),)), doc)


def apply_override(doc: LMap, text: str) -> None:
    """Apply one ``key.path=value`` override in place; the value is read as YAML."""
    file = f"--set {text}"
    key_path, sep, raw = text.partition("=")
    if not sep or not key_path.strip():
        raise PlanError("an override reads key.path=value (for example model.config=70b)",
                        Loc(file, 1, 1))
    value_loc = Loc(file, 1, len(key_path) + 2)
    value = _clone(_value(raw, file, len(key_path) + 1)) if raw.strip() else None
    keys = key_path.strip().split(".")
    node = doc
    for i, key in enumerate(keys[:-1]):
        if key in REPLACE_WHOLE and i == 0:
            rest = ".".join(keys[1:])
            child = node.get(key)
            if not isinstance(child, LMap):
                child = LMap(value_loc)
                node.put(key, child, value_loc, value_loc)
            if value is None:
                child.pop(rest, None)  # null removes, as in an extends child
            else:
                child.put(rest, value, Loc(file, 1, 1), value_loc)
            return
        child = node.get(key)
        if not isinstance(child, LMap):
            child = LMap(value_loc)
            node.put(key, child, Loc(file, 1, 1), value_loc)
        node = child
    if value is None:
        node.pop(keys[-1], None)
    else:
        node.put(keys[-1], value, Loc(file, 1, 1), value_loc)


@functools.lru_cache(maxsize=4096)
def _value(raw: str, file: str, columns: int) -> Any:
    """An override's value read as YAML, its locations at their columns in ``file``. Cached
    (``search`` applies the same few hundred overrides to thousands of variants): callers
    get a deep copy, since documents are changed in place."""
    value = load_text(raw, file)
    if isinstance(value, (LMap, LSeq)):
        _shift(value, columns)
    return value


def _clone(value: Any) -> Any:
    """A copy of a read value's mappings and lists (locations and scalars are immutable)."""
    if isinstance(value, LMap):
        out = LMap(value.loc)
        for k, v in value.items():
            out.put(k, _clone(v), value.key_loc(k), value.value_loc(k))
        return out
    if isinstance(value, LSeq):
        out = LSeq(value.loc)
        for i, v in enumerate(value):
            out.push(_clone(v), value.item_loc(i))
        return out
    return value


def _shift(value: Any, columns: int) -> None:
    """Move the locations inside a flow value read from an override to its real columns."""
    if isinstance(value, LMap):
        value.loc = Loc(value.loc.file, 1, value.loc.column + columns)
        for d in (value.key_locs, value.value_locs):
            for k, loc in d.items():
                d[k] = Loc(loc.file, 1, loc.column + columns)
        for v in value.values():
            _shift(v, columns)
    elif isinstance(value, LSeq):
        value.loc = Loc(value.loc.file, 1, value.loc.column + columns)
        value.item_locs = [Loc(x.file, 1, x.column + columns) for x in value.item_locs]
        for v in value:
            _shift(v, columns)


def _copy(m: LMap) -> LMap:
    out = LMap(m.loc)
    out.update(m)
    out.key_locs, out.value_locs = dict(m.key_locs), dict(m.value_locs)
    return out


def overridden(doc: LMap, overrides: Sequence[str]) -> LMap:
    """``doc`` with ``overrides`` applied, ``doc`` itself untouched: the mappings on each
    override's key path are copied before :func:`apply_override` changes them (the rest is
    shared, never changed). Many variants of one plan (``search``) without rereading it."""
    out = _copy(doc)
    for text in overrides:
        node = out
        for key in text.partition("=")[0].strip().split(".")[:-1]:
            child = node.get(key)
            if not isinstance(child, LMap):
                break
            node[key] = node = _copy(child)
        apply_override(out, text)
    return out


def read_document(path: str | Path, overrides: Sequence[str] = ()) -> LMap:
    """The merged plan document: the file, its ``extends`` chain, then the overrides."""
    p = Path(path)
    doc = _read(p, (str(p.resolve()),))
    for text in overrides:
        apply_override(doc, text)
    for section in ALTERNATIVES:
        keys = {t.partition("=")[0].strip().removeprefix(section + ".") for t in overrides
                if t.partition("=")[2].strip() not in ("", "null", "~")}
        one, node = _given_one(keys, section), doc.get(section)
        if one is not None and isinstance(node, LMap):
            for key in ALTERNATIVES[section]:
                if key != one:
                    node.pop(key, None)
    return doc
