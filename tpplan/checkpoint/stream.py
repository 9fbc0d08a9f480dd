"""A checkpoint's model tensors one at a time: what ``tpplan export --format hf`` streams.

:func:`~tpplan.checkpoint.sharded.read_model_state` holds every tensor of the model at once;
:class:`ModelTensors` holds one. Its metadata (every tensor's global shape and dtype) is read
once, without running code (:class:`~tpplan.checkpoint.integrity.SafeReader`); each
:meth:`ModelTensors.read` allocates the one full tensor and lets DCP copy every rank's slices
of it into place, reading those byte ranges of the shard files and nothing else. Memory: the
tensor, plus one slice as ``torch.load`` returns it, at a time.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from .integrity import SafeReader
from .sharded import MODEL_KEY

__all__ = ["ModelTensors"]


class _OnceReader(SafeReader):
    """:class:`SafeReader` that parses ``.metadata`` once for many loads."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        if getattr(self, "_metadata", None) is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata


class ModelTensors:
    """The model entries of the DCP checkpoint at ``path``, by the model's state-dict name.

    Example::

        >>> tensors = ModelTensors(Path("runs/llama/checkpoints/step-000100"))
        >>> for name in tensors.names():
        ...     w = tensors.read(name)            # the full tensor, on the CPU
    """

    def __init__(self, path: Path):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.path = Path(path)
        self._reader = _OnceReader(str(self.path))
        meta = self._reader.read_metadata().state_dict_metadata
        prefix = MODEL_KEY + "."
        self._meta = {key[len(prefix):]: m for key, m in meta.items()
                      if key.startswith(prefix) and isinstance(m, TensorStorageMetadata)}

    def names(self) -> list[str]:
        """Every model tensor's name, in the order the checkpoint lists them."""
        return list(self._meta)

    def __contains__(self, name: str) -> bool:
        return name in self._meta

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._meta[name].size)

    def dtype(self, name: str) -> torch.dtype:
        return self._meta[name].properties.dtype

    def read(self, name: str) -> torch.Tensor:
        """The full tensor ``name``, read from every shard that holds part of it."""
        tensor = torch.empty(self.shape(name), dtype=self.dtype(name))
        with warnings.catch_warnings():  # "assuming ... a single process": yes, on purpose
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.load({MODEL_KEY: {name: tensor}}, storage_reader=self._reader)
        return tensor
