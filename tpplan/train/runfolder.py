"""The run folder: one run at a time, what tpplan wrote there, restarts, and the preflight.

- **One run per folder.** Rank 0 holds ``.tpplan.lock`` (host, process id and its start
  time, launch id) while it trains. A lock whose process is gone from this host is stale
  and taken over; a live one, or one on another host, refuses the run with the holder
  named. The lock of an earlier round of the *same* launch (torchrun restarting its
  workers) is taken over too.
- **What tpplan wrote.** ``--overwrite`` removes only ``metrics.jsonl``, ``plan.yaml``,
  ``estimate.json``, ``batches/``, ``tensorboard/``, ``profile/`` and the ``step-NNNNNN``
  folders; anything else in the folder stays (W&B runs under ``wandb/`` are each their
  own run).
- **Restarts.** ``.tpplan-launch`` records the launch (torchrun's rendezvous id): a worker
  started with the id already recorded there is a restart of that launch and resumes by
  itself from the last intact checkpoint.
- **Preflight.** Before the process group: the checkpoint folder is a folder, every rank
  can create a file in it, and it has room for one checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .resume import Claim
    from .setup import Prepared

__all__ = ["LAUNCH_FILE", "LOCK_FILE", "RunLock", "launch_id", "preflight", "read_launch",
           "record_launch", "remove_written", "start_folder", "trim_metrics", "write_plan"]

LOCK_FILE = ".tpplan.lock"
LAUNCH_FILE = ".tpplan-launch"
WRITTEN_FILES = ("metrics.jsonl", "plan.yaml", "estimate.json")
WRITTEN_DIRS = ("batches", "tensorboard", "profile")


def launch_id() -> str | None:
    """torchrun's rendezvous id (the same on every node and every restart round of one
    launch); None outside torchrun or for its default id ``none``, which names nothing."""
    rid = os.environ.get("TORCHELASTIC_RUN_ID")
    return rid if rid and rid != "none" else None


def _start_ticks(pid: int) -> str | None:
    """A process's start time (clock ticks since boot), so a reused pid is not mistaken
    for the lock holder; None where /proc does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


@dataclass
class Holder:
    host: str
    pid: int
    start: str | None
    launch: str | None
    since: str

    def alive(self) -> bool | None:
        """True/False on this host; None (cannot tell) for another host."""
        if self.host != socket.gethostname():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # exists, owned by someone else
        return self.start is None or _start_ticks(self.pid) in (None, self.start)

    def __str__(self) -> str:
        return f"process {self.pid} on {self.host} (since {self.since})"


class RunLock:
    def __init__(self, run_dir: Path):
        self.path = run_dir / LOCK_FILE
        self.held = False

    def holder(self) -> Holder | None:
        try:
            d = json.loads(self.path.read_text())
            return Holder(str(d["host"]), int(d["pid"]), d.get("start"), d.get("launch"),
                          str(d.get("since", "?")))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError):
            return Holder("?", -1, None, None, "?")  # unreadable: treated as stale below

    def acquire(self) -> str | None:
        """Take the lock; return why not (one line) if another live run holds it."""
        me = launch_id()
        held = self.holder()
        if held is not None and held.pid != -1 and not (me and held.launch == me):
            alive = held.alive()
            if alive is not False:
                how = "is still running" if alive else "may still be running (another host)"
                return (f"{self.path.parent} is in use by another run: {held} {how}; wait for "
                        f"it, or choose another folder with --set metrics.run_dir=<folder>"
                        + ("" if alive else f" (if that run is gone, delete {self.path})"))
        info = {"host": socket.gethostname(), "pid": os.getpid(),
                "start": _start_ticks(os.getpid()), "launch": me,
                "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        tmp = self.path.with_name(f"{LOCK_FILE}.{os.getpid()}")
        tmp.write_text(json.dumps(info) + "\n")
        try:
            if held is None:
                os.link(tmp, self.path)  # atomic: fails if another run took it meanwhile
            else:
                os.replace(tmp, self.path)  # a stale lock (or our own launch's) taken over
        except FileExistsError:  # another run took it between our read and our link
            return f"{self.path.parent} is in use by another run: {self.holder()}"
        finally:
            tmp.unlink(missing_ok=True)
        self.held = True
        return None

    def release(self) -> None:
        if self.held:
            held = self.holder()
            if held is not None and held.pid == os.getpid():
                self.path.unlink(missing_ok=True)
            self.held = False


def record_launch(run_dir: Path, **extra: Any) -> None:
    data = {"launch": launch_id(), **extra}
    tmp = run_dir / f"{LAUNCH_FILE}.tmp"
    tmp.write_text(json.dumps(data) + "\n")
    os.replace(tmp, run_dir / LAUNCH_FILE)


def read_launch(run_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads((run_dir / LAUNCH_FILE).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def write_plan(run_dir: Path, plan) -> None:
    """``plan.yaml``: the resolved plan this run trains (extends and --set applied) -- unless
    the run was started from that very file, which is never replaced."""
    import yaml

    if Path(plan.source).resolve() == (run_dir / "plan.yaml").resolve():
        return
    tmp = run_dir / "plan.yaml.tmp"
    with open(tmp, "w") as f:
        f.write(f"# resolved from {plan.source}\n")
        yaml.safe_dump(plan.to_dict(), f, sort_keys=False)
    tmp.replace(run_dir / "plan.yaml")


def remove_written(run_dir: Path, ckpt_dir: Path) -> None:
    """``--overwrite``: delete what tpplan wrote, nothing else."""
    from ..checkpoint import is_step_folder

    for name in WRITTEN_FILES:
        (run_dir / name).unlink(missing_ok=True)
    for name in WRITTEN_DIRS:
        shutil.rmtree(run_dir / name, ignore_errors=True)
    if ckpt_dir.is_dir():
        for p in ckpt_dir.iterdir():
            if p.is_dir() and is_step_folder(p):
                shutil.rmtree(p, ignore_errors=True)


def trim_metrics(run_dir: Path, keep_up_to: int) -> int:
    """Keep the rows of steps ``<= keep_up_to``; drop a half-written line (a kill mid-write)
    and rows past the checkpoint a run resumes from, so the file is one curve. Returns the
    number of lines dropped."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
            ok = isinstance(row, dict) and isinstance(row.get("step"), int)
        except ValueError:
            ok = False
        if ok and row["step"] <= keep_up_to:
            kept.append(line)
        elif line.strip():
            dropped += 1
    tmp = path.with_name("metrics.jsonl.tmp")
    tmp.write_text("".join(r + "\n" for r in kept))
    os.replace(tmp, path)
    return dropped


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return ""


def preflight(ckpt_dir: Path, checkpoint_bytes: int, keep: int) -> tuple[str | None, str | None]:
    """(error, warning): the checkpoint folder must be a writable folder with room for one
    checkpoint; a warning when it cannot hold ``keep`` of them."""
    if ckpt_dir.exists() and not ckpt_dir.is_dir():
        return f"checkpoint folder {ckpt_dir} is a file, not a folder", None
    try:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        probe = ckpt_dir / f".tpplan-write-test-{socket.gethostname()}-{os.getpid()}"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as e:
        return (f"checkpoint folder {ckpt_dir} is not writable ({e.strerror}); fix its "
                f"permissions or set checkpoint.dir"), None
    free = shutil.disk_usage(ckpt_dir).free
    if free < checkpoint_bytes:
        return (f"checkpoint folder {ckpt_dir} has {_size(free)} free, one checkpoint needs "
                f"{_size(checkpoint_bytes)}; free space or set checkpoint.dir"), None
    existing = sum(1 for p in ckpt_dir.iterdir() if p.name.startswith("step-"))
    more = max(keep - existing, 1) if keep else 1
    if free < checkpoint_bytes * more:
        return None, (f"warning: {ckpt_dir} has {_size(free)} free, room for fewer than the "
                      f"{more} more checkpoints of {_size(checkpoint_bytes)} this run may keep")
    return None, None


def start_folder(prep: "Prepared", claimed: "Claim", start: int) -> list[str]:
    """Rank 0: the run folder as this run needs it; returns notes for the header."""
    notes = list(prep.notes) + claimed.notes
    if prep.overwrite:
        remove_written(prep.run_dir, prep.ckpt_dir)
    record_launch(prep.run_dir)
    write_plan(prep.run_dir, prep.plan)
    from ..ft.groups import group_index

    # a replica group keeps its rows (it does not run those steps again: it takes the weights
    # of a later step from a live group); a torchrun restart otherwise runs them again
    in_group = prep.plan.fault_tolerance is not None and group_index() is not None
    dropped = trim_metrics(prep.run_dir, 2 ** 62 if in_group else start)
    if dropped:
        notes.append(f"metrics.jsonl: dropped {dropped} line(s) past step {start} "
                     f"(steps the checkpoint does not hold, or a line cut off by a kill)")
    return notes
