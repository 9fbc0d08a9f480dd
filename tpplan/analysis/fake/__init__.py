"""What a dry run runs on instead of devices: no process, no memory.

- ``group``: the fake process group (PyTorch's ``fake`` backend at any world size) and what
  the dry run changes in torch while it is up (through :mod:`tpplan._torch`).
- ``tensors``: the fake tensor mode a step runs in, with a cheaper key for its cache.
- ``hf_masks``: where a model's code reads tensor values (HF mask code), answered as the real
  run decides.
"""

from ...exports import lazy_exports

__all__, __getattr__ = lazy_exports(__name__, {
    "group": ["fake_process_group", "fewer_collections", "forget_meshes"],
    "tensors": ["TraceMode", "fake_mode"],
})
