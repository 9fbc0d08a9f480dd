"""``--profile START:END``: torch.profiler traces of those steps, per rank, and a table of
each step's compute against its collectives per mesh dimension.

While the window is open every collective the step issues is wrapped in a profiler
annotation ``tpplan.comm <dim> <kind> <phase>``: its mesh dimension comes from its process
group (the mesh's ``tp``, ``dp_shard``, ``dp_replicate``, ``pp`` groups by name, as the dry
run's communication table names them; ``world`` for the default group), its phase is the
part of the trainer's step it runs in (``step``: forward and backward, what the dry run
counts; ``clip`` and ``loss``: the trainer's own gradient norm and loss reductions). The
annotations are visible in Perfetto / chrome://tracing next to the operators.

Files (in ``<run_dir>/profile/``): ``trace-rank<R>.json`` (Chrome trace format, open it in
https://ui.perfetto.dev), ``summary-rank<R>.json`` (the table's figures), and on CUDA
``memory-rank<R>.pickle`` (``torch.cuda.memory._record_memory_history``'s snapshot, for
https://pytorch.org/memory_viz). See :func:`summarize` for what the table's times are.
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from .._torch.cuda import dump_memory_snapshot, record_memory_history, stop_memory_history
from ..parallel.mesh import group_dim

__all__ = ["StepProfiler", "format_table", "summarize"]

# Collective operators as the dispatcher sees them (c10d: FSDP2 and the trainer;
# _c10d_functional: DTensor), by the kind the dry run's tables use.
KINDS = {"all_reduce": "all_reduce", "allreduce_": "all_reduce",
         "all_gather_into_tensor": "all_gather", "_allgather_base_": "all_gather",
         "allgather_": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
         "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
         "all_to_all_single": "all_to_all", "alltoall_base_": "all_to_all",
         "broadcast_": "broadcast", "send": "send", "recv_": "recv", "scatter_": "scatter"}
STEP, COMM = "tpplan.step ", "tpplan.comm "
CPU_ONLY_SNAPSHOT = ("memory snapshot: CUDA only (torch.cuda.memory._record_memory_history); "
                     "not recorded on CPU")


def _group_dims(mesh) -> tuple[dict[str, str], dict[tuple[int, ...], str]]:
    """Process group name -> mesh dimension, and this rank's group ranks -> dimension."""
    by_name, by_ranks = {}, {}
    for name in mesh.mesh_dim_names:
        group = mesh[name].get_group()
        by_name[group.group_name] = name
        by_ranks.setdefault(tuple(dist.get_process_group_ranks(group)), name)
    by_name.setdefault(dist.group.WORLD.group_name, "world")
    return by_name, by_ranks


class _Annotate:
    """A dispatch mode that wraps each collective in a ``tpplan.comm`` annotation."""

    def __init__(self, mesh):
        from .._torch.dispatch import TorchDispatchMode, op_packet

        by_name, by_ranks = _group_dims(mesh)
        owner = self
        self.phase = "step"

        def dim_of(group_name: str) -> str:
            """The mesh's own groups by name; any other (the experts' ep and efsdp groups,
            a flattened dimension) by the dimension DeviceMesh made it for, as the dry run
            names them (their ranks may be another dimension's, or no dimension's: ep 2 of
            dp_shard 4); else by its ranks. A group spanning every rank is the default
            group, the mesh's own (docs/training.md)."""
            if group_name not in by_name:
                from .._torch.collectives import resolve_process_group

                dim = group_dim(group_name)
                try:
                    ranks = () if dim else tuple(dist.get_process_group_ranks(
                        resolve_process_group(group_name)))
                except (RuntimeError, ValueError, KeyError):
                    ranks = ()
                by_name[group_name] = dim or by_ranks.get(ranks) or (
                    "world" if len(ranks) == dist.get_world_size() else
                    "ranks:" + ",".join(map(str, ranks)) if ranks else "other")
            return by_name[group_name]

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                from torch.distributed.tensor import DTensor

                if any(issubclass(t, DTensor) for t in types):
                    return NotImplemented
                name = op_packet(func).__name__
                if name not in KINDS or func.namespace not in ("c10d", "_c10d_functional"):
                    return func(*args, **(kwargs or {}))
                if func.namespace == "c10d":
                    pg = next(a for a in args if isinstance(a, torch.ScriptObject))
                    group = dist.ProcessGroup.unbox(pg).group_name
                else:
                    group = args[-1] if args and isinstance(args[-1], str) else \
                        str((kwargs or {}).get("group_name", "?"))
                label = f"{COMM}{dim_of(group)} {KINDS[name]} {owner.phase}"
                with torch.profiler.record_function(label):
                    return func(*args, **(kwargs or {}))

        self.mode = Mode()


class StepProfiler:
    """Profiles the steps ``window`` (first, last; both included) on this rank. Use
    :meth:`step` around each step and :meth:`phase` around the trainer's own reductions."""

    def __init__(self, window: tuple[int, int] | None, run_dir: Path, rank: int,
                 device_type: str, mesh):
        self.window, self.rank, self.device_type, self.mesh = window, rank, device_type, mesh
        self.folder = run_dir / "profile"
        self.prof = None
        self.annotate: _Annotate | None = None
        self.summary: dict[str, Any] | None = None
        self.notes: list[str] = []

    def _start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.folder.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU]
        if self.device_type == "cuda":
            activities.append(ProfilerActivity.CUDA)
            record_memory_history(max_entries=200_000)
        self.prof = profile(activities=activities)
        self.prof.__enter__()
        self.annotate = _Annotate(self.mesh)
        self.annotate.mode.__enter__()

    def _stop(self) -> None:
        self.annotate.mode.__exit__(None, None, None)
        self.prof.__exit__(None, None, None)
        trace = self.folder / f"trace-rank{self.rank}.json"
        self.prof.export_chrome_trace(str(trace))
        self.prof = self.annotate = None
        if self.device_type == "cuda":
            snapshot = self.folder / f"memory-rank{self.rank}.pickle"
            dump_memory_snapshot(str(snapshot))
            stop_memory_history()
            self.notes.append(f"memory snapshot: {snapshot} (drag it onto "
                              f"https://pytorch.org/memory_viz)")
        else:
            self.notes.append(CPU_ONLY_SNAPSHOT)
        self.summary = summarize(json.loads(trace.read_text()))
        self.summary["trace"] = str(trace)
        (self.folder / f"summary-rank{self.rank}.json").write_text(
            json.dumps(self.summary, indent=1) + "\n")

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        if self.window is None or not self.window[0] <= step <= self.window[1]:
            yield
            return
        if self.prof is None:
            self._start()
        with torch.profiler.record_function(f"{STEP}{step}"):
            yield

    def mark(self, step: int) -> dict[str, bool]:
        """``{"profiled": True}`` for a step in the window (slower: the profiler runs)."""
        w = self.window
        return {"profiled": True} if w is not None and w[0] <= step <= w[1] else {}

    def done(self, step: int, stopped: bool = False) -> bool:
        """After a step (outside its timing): write the traces once the window is over, or
        when the run stops inside it; True when they were written now."""
        if self.prof is None or not (stopped or step >= self.window[1]):
            return False
        self._stop()
        return True

    def show(self, note) -> None:
        """Rank 0's table through ``note`` (the reporter's: a no-op on other ranks)."""
        note(f"profile (rank 0; every rank's trace and figures in {self.folder}):")
        for line in format_table(self.summary) + self.notes:
            note("  " + line)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.annotate is None:
            yield
            return
        self.annotate.phase = name
        try:
            yield
        finally:
            self.annotate.phase = "step"


def _top_level(events: list[dict]) -> list[dict]:
    """The events not inside another one (events of one thread, sorted by start)."""
    out, end = [], -1.0
    for e in events:
        if e["ts"] >= end:
            out.append(e)
            end = e["ts"] + e["dur"]
    return out


def summarize(trace: dict[str, Any]) -> dict[str, Any]:
    """Per profiled step: its wall time; ``compute``, the main thread's time in operators
    outside collectives and their waits (on CUDA: the GPU kernels' time, NCCL's left out);
    per mesh dimension and kind the number of collectives the step issued (phase ``step``,
    what the dry run counts) and their time -- on gloo the worker thread's time from a
    collective's start to its end (it runs beside the main thread, so it can overlap
    compute), on CUDA the NCCL kernels' time; and the trainer's own reductions (``clip``,
    ``loss``) apart. Times in milliseconds."""
    # On CUDA each annotation (a step, a collective's) is also drawn on the GPU's timeline
    # as a ``gpu_user_annotation``: only the host's copy is read (once per step).
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e
              and e.get("cat") != "gpu_user_annotation"]
    steps = sorted((e for e in events if e["name"].startswith(STEP)), key=lambda e: e["ts"])
    if not steps:
        return {"steps": []}
    main = steps[0]["tid"]
    comms = sorted((e for e in events if e["name"].startswith(COMM)), key=lambda e: e["ts"])
    # gloo runs each process group's collectives on that group's own worker threads: a
    # thread's dimension is the one of the annotations its collectives most often follow.
    votes: dict[Any, Counter] = defaultdict(Counter)
    workers = sorted((e for e in events if e["name"].startswith("gloo:")), key=lambda e: e["ts"])
    i = -1
    for w in workers:
        while i + 1 < len(comms) and comms[i + 1]["ts"] <= w["ts"]:
            i += 1
        if i >= 0:
            votes[w["tid"]][comms[i]["name"].split()[1]] += 1
    thread_dim = {tid: c.most_common(1)[0][0] for tid, c in votes.items()}
    # CUDA: NCCL kernels carry the External id of the operator that launched them.
    gpu = [e for e in events if e.get("cat") == "kernel"]
    kernels = [e for e in gpu if "nccl" in e["name"].lower()]
    ext_dim = {}
    for c in comms if kernels else []:
        for e in events:
            if e.get("tid") == c["tid"] and c["ts"] <= e["ts"] <= c["ts"] + c["dur"] and \
                    "External id" in e.get("args", {}):
                ext_dim[e["args"]["External id"]] = c["name"].split()[1]
    rows = []
    for s in steps:
        lo, hi = s["ts"], s["ts"] + s["dur"]
        inside = sorted((e for e in events if e["tid"] == main and lo < e["ts"] < hi
                         and not e["name"].startswith(("tpplan.", "gloo:"))),
                        key=lambda e: e["ts"])
        busy = sum(e["dur"] for e in _top_level(inside))
        waits = _top_level(sorted(
            [e for e in inside if e["name"].startswith(("c10d::", "_c10d_functional::"))]
            + [c for c in comms if c["tid"] == main and lo <= c["ts"] <= hi],
            key=lambda e: e["ts"]))
        count: Counter = Counter()
        other: Counter = Counter()
        for c in comms:
            if lo <= c["ts"] <= hi:
                _, dim, kind, phase = c["name"].split()
                (count if phase == "step" else other)[f"{dim} {kind}"] += 1
        seconds: Counter = Counter()
        for w in workers:
            if lo <= w["ts"] <= hi and w["tid"] in thread_dim:
                seconds[thread_dim[w["tid"]]] += w["dur"]
        for k in kernels:
            dim = ext_dim.get(k.get("args", {}).get("External id"))
            if dim is not None and lo <= k["ts"] <= hi:
                seconds[dim] += k["dur"]
        compute = max(busy - sum(e["dur"] for e in waits), 0)
        if gpu:  # CUDA: the kernels' time, NCCL's left out
            compute = sum(k["dur"] for k in gpu if lo <= k["ts"] <= hi and k not in kernels)
        rows.append({"step": int(s["name"][len(STEP):]), "wall_ms": s["dur"] / 1e3,
                     "compute_ms": compute / 1e3,
                     "collectives": dict(sorted(count.items())),
                     "trainer_collectives": dict(sorted(other.items())),
                     "collective_ms": {d: v / 1e3 for d, v in sorted(seconds.items())}})
    return {"steps": rows}


def format_table(summary: dict[str, Any]) -> list[str]:
    """The profile table as lines: per step, wall and compute time, and per mesh dimension
    the collectives' count and time."""
    rows = summary.get("steps", [])
    dims = sorted({k.split()[0] for r in rows for k in r["collectives"]}
                  | {d for r in rows for d in r["collective_ms"]})
    head = f"{'step':>6} {'wall ms':>9} {'compute ms':>11}" + "".join(
        f" {d + ' n / ms':>18}" for d in dims) + "  trainer's own (loss, grad norm)"
    lines = [head]
    for r in rows:
        cells = ""
        for d in dims:
            n = sum(v for k, v in r["collectives"].items() if k.split()[0] == d)
            ms = r["collective_ms"].get(d, 0.0)
            cells += " " + f"{n} / {ms:.1f}".rjust(18)
        own = ", ".join(f"{k} ×{v}" for k, v in r["trainer_collectives"].items()) or "-"
        lines.append(f"{r['step']:>6} {r['wall_ms']:>9.1f} {r['compute_ms']:>11.1f}{cells}  {own}")
    return lines
