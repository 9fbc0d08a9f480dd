"""What every subcommand shares: the plan flags, printing errors, a console, and writing a
generated plan (``suggest``, ``import-hf``) then validating it right away."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import os
import sys
import tempfile
from typing import TextIO

from ..plan.errors import UNKNOWN, Loc, PlanError, PlanErrors

__all__ = ["add_plan_args", "console", "emit", "fewer_collections", "print_errors", "size"]


_FROZEN_AT_EXIT: list = []


@contextlib.contextmanager
def fewer_collections(allocations: int = 100_000):
    """Python's cyclic garbage collector run every ``allocations`` net allocations instead of
    its default 700, inside the block, and not over what is still alive when the interpreter
    exits. A dry run allocates millions of objects that live on (``import torch``'s modules,
    fake tensors, DTensor specs, a 405B model's modules): at the default pace the collector
    walks them again and again, and the interpreter's last collection at exit walks them all
    once more (together ~1 s of `validate` at 405B, docs/benchmarks.md). Nothing is left
    uncollected while the process runs; at its exit, what is alive is frozen (``gc.freeze``
    in an ``atexit`` hook: the other hooks still run and the modules are still cleared, which
    frees what is not in a reference cycle; the cycles are left to the operating system)."""
    before = gc.get_threshold()
    gc.set_threshold(allocations, *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)
        if not _FROZEN_AT_EXIT:  # once, however many runs
            _FROZEN_AT_EXIT.append(atexit.register(gc.freeze))


def print_errors(errors: PlanErrors | list[PlanError], stream: TextIO | None = None) -> None:
    """``file:line:col: error: message`` per mistake, then how many.

    An error about a whole file (it cannot be read) reads ``file: error: message``, one about
    no file ``error: message``; the count follows only a list of errors at lines of a plan."""
    stream = stream or sys.stderr
    errors = errors.errors if isinstance(errors, PlanErrors) else errors
    for e in errors:
        print(f"{where(e.loc)}error: {e.message}", file=stream)
    n = len(errors)
    if any(e.loc.line for e in errors):
        print(f"{n} error{'s' if n != 1 else ''} in the plan", file=stream)


def where(loc: Loc) -> str:
    """``file:line:col: ``, ``file: `` for a whole file, or nothing for no file at all."""
    if loc.line:
        return f"{loc}: "
    return f"{loc.file}: " if loc != UNKNOWN else ""


def add_plan_args(p: argparse.ArgumentParser) -> None:
    """``--plan`` and ``--set``, the same on every subcommand."""
    p.add_argument("--plan", required=True, help="the plan YAML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a plan key, e.g. --set model.config=70b (repeatable)")


def console(width: int):
    """A rich console; ``width`` columns when the output is not a terminal (logs, pipes)."""
    from rich.console import Console

    c = Console()
    if not c.is_terminal:
        c.width = width
    return c


def size(n: float | None) -> str:
    """Bytes for people: ``1.50 GiB``."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def emit(text: str, output: str | None, tp: int, notes: list[str], stream: TextIO,
         inputs: list = ()) -> int:
    """Write ``text`` (or print it), then dry-run it at world size ``tp``; 1 if invalid.

    ``output`` is written atomically, and refused when it is one of ``inputs`` (the files
    the command read: ``byom.outputs.model_inputs``)."""
    from ..analysis.dryrun import dry_run
    from ..byom.outputs import write_text

    if output:
        write_text(output, text, inputs)
        path = output
    else:
        sys.stdout.write(text)
        fd, path = tempfile.mkstemp(suffix=".yaml", dir=".")
        with os.fdopen(fd, "w") as f:
            f.write(text)
    try:
        result = dry_run(path, tp)
    finally:
        if not output:
            os.unlink(path)
    if not result.ok:
        print_errors(result.errors, stream)
        return 1
    where = f"wrote {output}" if output else "the plan above"
    print(f"{where}: valid at world size {tp} ({len(result.report.modules)} modules with rules "
          f"or parameters); {len(notes)} thing(s) left for you to decide, listed at its end",
          file=stream)
    return 0


def device_from_args(args: argparse.Namespace):
    """The device to check against, or None; SystemExit(2) with the reason for a bad one."""
    from ..plan.devices import DEVICES, Device, parse_bytes
    from ..plan.errors import nearest

    if args.device and args.device_memory:
        print("error: --device and --device-memory: give one", file=sys.stderr)
        raise SystemExit(2)
    if args.device:
        name = args.device.lower()
        if name not in DEVICES:
            print(f"error: --device {args.device}: no such preset{nearest(name, DEVICES)}; "
                  f"presets: {', '.join(DEVICES)} (or --device-memory SIZE)", file=sys.stderr)
            raise SystemExit(2)
        return DEVICES[name]
    if args.device_memory:
        try:
            memory = parse_bytes(args.device_memory)
        except ValueError as e:
            print(f"error: --device-memory {e}", file=sys.stderr)
            raise SystemExit(2) from None
        return Device(f"{args.device_memory} device", memory, description="--device-memory")
    return None


def bad_world_size(n: int, flag: str) -> bool:
    """Whether the dry run cannot simulate ``n`` ranks; if so the reason is printed after the
    command-line ``flag`` that gave ``n`` (the command then exits 2)."""
    from ..analysis.dryrun import world_size_problem

    problem = world_size_problem(n)
    if problem:
        print(f"error: {flag} {problem}", file=sys.stderr)
    return problem is not None
