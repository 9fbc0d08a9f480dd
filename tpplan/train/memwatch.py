"""The step's memory as the device reports it, for the end-of-run line against the dry run.

- **CUDA**: ``torch.cuda.max_memory_allocated()`` over the run (the caching allocator's
  peak of live tensor bytes: what the dry run predicts, without the allocator's cache).
- **CPU** (Linux, glibc): the kernel's peak resident set (``VmHWM``) during the first
  step this process runs (started with AdamW's state, made beforehand as its first step
  would make it, so that the step holds what every later one, and the dry run's, holds),
  less the resident set just before it (the peak is reset first
  through ``/proc/self/clear_refs``), less the file-backed pages the step faulted in (code
  of kernels run for the first time), plus the bytes of the tensors already live when the
  step starts (parameters, buffers, optimizer state: summed exactly). For that one step,
  glibc's ``malloc`` serves every block of 64 KiB or more with its own ``mmap`` (``mallopt
  M_MMAP_THRESHOLD``), so a freed tensor leaves the resident set at once, as it leaves
  PyTorch's count on CUDA; with glibc's default the heap keeps freed blocks and the
  resident set reads about 1.5x the live tensors. After the step the threshold is set to
  32 MiB, the largest glibc's own dynamic threshold reaches. Elsewhere nothing is measured.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import torch

from ..checkpoint.optim_state import init_state

__all__ = ["StepMemory", "largest_peak", "live_bytes", "step_start_tensors"]

_STATUS = Path("/proc/self/status")
_CLEAR = Path("/proc/self/clear_refs")


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MEASURED_THRESHOLD = 64 * 1024
AFTER_THRESHOLD = 32 * 1024 * 1024


def _mallopt(value: int) -> bool:
    try:
        return bool(ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, value))
    except (OSError, AttributeError):  # not glibc
        return False


def _status() -> dict[str, int]:
    text = _STATUS.read_text()
    return {k: int(m.group(1)) * 1024 for k in ("VmRSS", "VmHWM", "RssFile")
            if (m := re.search(rf"^{k}:\s+(\d+) kB", text, re.M))}


def live_bytes(tensors) -> int:
    """Bytes of the local storages behind ``tensors``, each storage once."""
    from torch.distributed.tensor import DTensor

    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if isinstance(t, DTensor) else t
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


class StepMemory:
    """Measures the peak of one step (see the module docstring); ``peak`` is None until a
    step was measured, or where the device gives no figure."""

    def __init__(self, device_type: str):
        self.device_type = device_type
        self.peak: int | None = None
        self.how = ""
        self._armed = False
        self._before: dict[str, int] = {}
        self.cpu_ok = device_type == "cpu" and _STATUS.exists() and _CLEAR.exists()

    def before(self, parts: list, optimizers: list) -> None:
        """Call just before the step, with what it starts from (the model's parts and the
        optimizers)."""
        if self.peak is not None or not self.cpu_ok:
            return
        if not _mallopt(MEASURED_THRESHOLD):
            self.cpu_ok = False
            return
        for optimizer in optimizers:  # the step starts as every later one does: with
            if not optimizer.state:    # AdamW's state (made now, as its step would)
                init_state(optimizer)
        live = live_bytes(step_start_tensors(parts, optimizers))
        try:
            _CLEAR.write_text("5")  # resets VmHWM to the current resident set
        except OSError:
            _mallopt(AFTER_THRESHOLD)
            self.cpu_ok = False
            return
        self._before = _status()
        self._live = live
        self._armed = True

    def after(self, step: int) -> None:
        if self.device_type == "cuda":
            self.peak = torch.cuda.max_memory_allocated()
            self.how = "torch.cuda.max_memory_allocated"
            return
        if not self._armed:
            return
        self._armed = False
        now = _status()
        _mallopt(AFTER_THRESHOLD)
        grown = now["VmHWM"] - self._before["VmRSS"]
        code = max(now.get("RssFile", 0) - self._before.get("RssFile", 0), 0)
        self.peak = self._live + max(grown - code, 0)
        self.step = step
        self.how = f"CPU resident set, step {step}"


def step_start_tensors(parts: list, optimizers: list) -> list[torch.Tensor]:
    """What a step starts with: parameters, buffers and the optimizer's state."""
    return [t for part in parts for t in (*part.parameters(), *part.buffers())] + [
        v for o in optimizers for st in o.state.values() for v in st.values()
        if isinstance(v, torch.Tensor)]


def largest_peak(memory: StepMemory, device: torch.device) -> int | None:
    """The largest measured peak over the ranks (every rank calls this), or None."""
    import torch.distributed as dist

    value = torch.tensor(float(memory.peak if memory.peak is not None else -1), device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item()) if value.item() >= 0 else None
