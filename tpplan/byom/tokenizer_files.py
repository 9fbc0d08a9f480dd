"""Which tokenizer a plan's model was trained with, and copying its files next to an export.

The tokenizer is the plan's ``data.tokenizer`` (a ``tokenizer.json`` or an HF folder), else
the ``model.pretrained`` folder when it holds tokenizer files; else the run trained on bytes
(vocabulary 256), which needs no files. A relative path is looked for next to the plan, then
from the working folder.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from ..models.hf import TOKENIZER_FILES
from ..plan.specs import plan_relative
from ..plan.yamlio import plain

__all__ = ["copy_tokenizer_files", "has_tokenizer", "plan_tokenizer", "tokenizer_source",
           "tokenizer_vocab"]

# What AutoTokenizer (and generation) reads from a model folder, where present.
COPIED = (*TOKENIZER_FILES, "generation_config.json")


def has_tokenizer(folder: Path) -> bool:
    return (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file()


def _path(value: Any, base: Path | None) -> Path | None:
    if not isinstance(value, str) or not value:
        return None
    return Path(plan_relative(str(Path(value).expanduser()), str(base) if base else None))


def tokenizer_source(plan_dict: dict[str, Any], base: Path | None = None) -> Path | None:
    """The tokenizer file or folder of a plan (as plain data; ``base``: the plan's folder),
    or None: bytes. Read defensively: a plan without these keys is a byte-level run."""
    data, model = plan_dict.get("data"), plan_dict.get("model")
    given = data.get("tokenizer") if isinstance(data, dict) else None
    if isinstance(given, dict):  # {path: ...} or {name: ...}: whichever the data section uses
        given = given.get("path") or given.get("name")
    if (path := _path(given, base)) is not None:
        return path
    pretrained = _path(model.get("pretrained") if isinstance(model, dict) else None, base)
    if pretrained is not None and pretrained.is_dir() and has_tokenizer(pretrained):
        return pretrained
    return None


def plan_tokenizer(plan: Any, plan_file: Path) -> Path | None:
    """:func:`tokenizer_source` of a loaded plan (a :class:`tpplan.Plan`) read from ``plan_file``."""
    return tokenizer_source(plain(plan.document) if plan.document is not None else {},
                            Path(plan_file).parent)


def copy_tokenizer_files(source: Path, dest: Path) -> list[str]:
    """Copy the tokenizer files of ``source`` (a folder, or a ``tokenizer.json`` whose folder
    may hold the rest) into ``dest``; return their names. ``OSError`` if ``source`` is missing."""
    source = Path(source)
    if source.is_file():
        shutil.copyfile(source, dest / "tokenizer.json")
        copied = ["tokenizer.json"]
        if source.name != "tokenizer.json":
            return copied  # a lone vocabulary file: its neighbours are not its own
        folder = source.parent
    elif source.is_dir():
        folder, copied = source, []
    else:
        raise FileNotFoundError(2, "no such file or folder (the plan's tokenizer)", str(source))
    for name in COPIED:
        if name not in copied and (folder / name).is_file():
            shutil.copyfile(folder / name, dest / name)
            copied.append(name)
    return copied


def tokenizer_vocab(source: Path) -> int | None:
    """The vocabulary size of a ``tokenizer.json`` (or a folder's), added tokens included;
    None when there is no such file to read."""
    path = Path(source) / "tokenizer.json" if Path(source).is_dir() else Path(source)
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
    except Exception as e:  # noqa: BLE001 - the library's parse errors have no common base
        raise ValueError(f"'{path}' is not a tokenizer file the tokenizers library reads: "
                         f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from None
