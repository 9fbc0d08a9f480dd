"""What makes a checkpoint trustworthy: a manifest of every file's size and SHA-256, and a
trainer state that cannot run code.

``manifest.json`` is written into the checkpoint last (before the folder's atomic rename):
each rank hashes the shards it wrote itself, in parallel, and rank 0 adds the rest. Checking
comes in two depths:

- :func:`check_structure` -- every rank, before any process group: the manifest and the
  trainer state parse, every listed file exists with its recorded size. Cheap (no reads),
  and it finds truncated, missing and emptied files.
- :func:`check_contents` -- collectively, after the process group: the files are dealt out
  over the ranks, each rank hashes its share, and every rank learns every mismatch. It
  finds flipped bytes that leave sizes alone (the silent kind of corruption).

No checkpoint runs code when it is read. ``trainer.json`` replaces the pickled
``trainer.pt`` of older checkpoints: plain JSON, the RNG state as hex; a legacy
``trainer.pt`` is read with ``torch.load(weights_only=True)``, which refuses anything but
tensors and plain containers. DCP's own ``.metadata`` is a pickle that
``FileSystemReader`` loads with plain ``pickle.load``; :class:`SafeReader` reads it with an
unpickler that only builds DCP's metadata classes, sizes, dtypes and paths. (The shards
themselves DCP reads with ``torch.load(weights_only=True)``.)
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta

from .._torch.checkpoint import metadata_path

__all__ = [
    "LEGACY_TRAINER_FILE", "MANIFEST_FILE", "TRAINER_FILE", "Damaged", "SafeReader", "check_contents",
    "check_structure", "hash_files", "read_trainer_state", "write_manifest",
    "write_trainer_state",
]

TRAINER_FILE = "trainer.json"
LEGACY_TRAINER_FILE = "trainer.pt"  # written by tpplan before checkpoints had a manifest
MANIFEST_FILE = "manifest.json"
CHUNK = 16 << 20


class Damaged(Exception):
    """A checkpoint that must not be loaded; the message names the file and the problem."""

    def __init__(self, path: Path, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path, self.problem = path, problem


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def hash_files(folder: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    return {n: {"bytes": (folder / n).stat().st_size, "sha256": sha256(folder / n)}
            for n in names}


def write_trainer_state(folder: Path, state: dict[str, Any]) -> None:
    """``state`` with its ``rng`` tensor as hex; everything else must be JSON already."""
    out = dict(state)
    if isinstance(out.get("rng"), torch.Tensor):
        out["rng"] = bytes(out["rng"].to(torch.uint8).tolist()).hex()
    _write_json(folder / TRAINER_FILE, out)


def read_trainer_state(folder: Path) -> dict[str, Any]:
    """The trainer state of a checkpoint; :class:`Damaged` if it is unreadable."""
    path = folder / TRAINER_FILE
    if not path.exists() and (folder / LEGACY_TRAINER_FILE).exists():
        return _read_legacy(folder / LEGACY_TRAINER_FILE)
    try:
        state = json.loads(path.read_text())
    except OSError as e:
        raise Damaged(path, f"cannot be read ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise Damaged(path, f"is not valid JSON ({e})") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise Damaged(path, "holds no training step")
    if isinstance(state.get("rng"), str):
        try:
            state["rng"] = torch.tensor(list(bytes.fromhex(state["rng"])), dtype=torch.uint8)
        except ValueError:
            raise Damaged(path, "holds an RNG state that is not hex") from None
    return state


def _read_legacy(path: Path) -> dict[str, Any]:
    try:
        state = torch.load(path, weights_only=True)  # tensors and containers only: no code
    except Exception as e:  # noqa: BLE001 - any failure means the same to the user
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise Damaged(path, f"cannot be loaded safely ({first[:200]})") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise Damaged(path, "holds no training step")
    return state


def write_manifest(folder: Path, own: dict[str, dict[str, Any]]) -> None:
    """Rank 0: ``own`` (the entries the ranks hashed for their shards) plus every other
    file in ``folder``; the manifest itself is written last, atomically."""
    files = dict(own)
    for p in sorted(folder.iterdir()):
        if p.is_file() and p.name not in files and p.name != MANIFEST_FILE:
            files.update(hash_files(folder, [p.name]))
    _write_json(folder / MANIFEST_FILE, {"format": 1, "files": files})


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(folder: Path) -> dict[str, dict[str, Any]] | None:
    """The manifest's files, or None for a checkpoint written before manifests existed."""
    path = folder / MANIFEST_FILE
    if not path.exists():
        return None
    try:
        files = json.loads(path.read_text())["files"]
        ok = all(isinstance(e.get("bytes"), int) and isinstance(e.get("sha256"), str)
                 for e in files.values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise Damaged(path, "is not a valid manifest")
    return files


def check_structure(folder: Path) -> dict[str, Any]:
    """Sizes against the manifest, DCP's metadata and the trainer state readable (safely);
    return the trainer state. Raises :class:`Damaged` naming the first bad file."""
    files = read_manifest(folder)
    for name, entry in sorted((files or {}).items()):
        p = folder / name
        if not p.is_file():
            raise Damaged(p, "is missing")
        size = p.stat().st_size
        if size != entry["bytes"]:
            raise Damaged(p, f"is {size:,} bytes, the manifest says {entry['bytes']:,} "
                             f"({'truncated' if size < entry['bytes'] else 'grown'})")
    SafeReader(str(folder)).read_metadata()
    return read_trainer_state(folder)


def check_contents(folder: Path) -> list[str]:
    """Collective: every file's SHA-256 against the manifest, the files dealt out over the
    ranks. Returns the same list of problems on every rank (empty: intact)."""
    files = read_manifest(folder) or {}
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    mine = []
    for name in sorted(files)[rank::world]:
        try:
            if sha256(folder / name) != files[name]["sha256"]:
                mine.append(f"{folder / name}: contents do not match the manifest's SHA-256 "
                            f"(corrupted on disk)")
        except OSError as e:
            mine.append(f"{folder / name}: cannot be read ({e.strerror})")
    if world == 1:
        return mine
    gathered: list[list[str]] = [[] for _ in range(world)]
    dist.all_gather_object(gathered, mine)
    return sorted(p for part in gathered for p in part)


class _MetadataUnpickler(pickle.Unpickler):
    """Builds what DCP's ``.metadata`` holds and nothing else: classes of
    ``torch.distributed.checkpoint``, ``torch.Size``, dtypes, layouts, memory formats, paths.
    Anything else (``os.system``, ``builtins.eval``, ...) is refused before it is called."""

    def find_class(self, module: str, name: str):
        obj = None
        if module.startswith("torch.distributed.checkpoint."):
            found = super().find_class(module, name)
            obj = found if isinstance(found, type) else None
        elif module == "torch":
            found = getattr(torch, name, None)
            ok = (torch.dtype, torch.layout, torch.memory_format)
            obj = found if found is torch.Size or isinstance(found, ok) else None
        elif (module, name) in {("torch.serialization", "_get_layout"),
                                ("collections", "OrderedDict"),
                                ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
                                ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath")}:
            obj = super().find_class(module, name)
        if obj is None:
            raise pickle.UnpicklingError(f"refers to {module}.{name}, which a checkpoint's "
                                         f"metadata never needs")
        return obj


class SafeReader(FileSystemReader):
    """DCP's file reader, with ``.metadata`` read by :class:`_MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = metadata_path(self, kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError,
                ValueError) as e:
            raise Damaged(Path(path), f"cannot be loaded safely ({e})") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
