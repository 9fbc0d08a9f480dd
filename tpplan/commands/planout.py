"""Writing a generated plan and validating it right away (suggest, import-hf)."""

from __future__ import annotations

import os
import sys
import tempfile
from typing import TextIO

from ..cli import print_errors
from ..errors import PlanErrors


def relocate(model: dict, from_dir: str, output: str | None) -> dict:
    """Keep a relative ``hf_config`` path pointing at the same file from the new plan's folder."""
    path = model.get("hf_config")
    if not path or os.path.isabs(path):
        return model
    target = os.path.join(from_dir, path)
    to_dir = os.path.dirname(os.path.abspath(output)) if output else os.getcwd()
    return {**model, "hf_config": os.path.relpath(os.path.abspath(target), to_dir)}


def emit(text: str, output: str | None, tp: int, notes: list[str], stream: TextIO) -> int:
    """Write ``text`` (or print it), then dry-run it at world size ``tp``; 1 if invalid."""
    from ..dryrun import dry_run

    if output:
        with open(output, "w") as f:
            f.write(text)
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
        print_errors(PlanErrors(result.errors), stream)
        return 1
    where = f"wrote {output}" if output else "the plan above"
    print(f"{where}: valid at world size {tp} ({len(result.report.modules)} modules with rules "
          f"or parameters); {len(notes)} thing(s) left for you to decide, listed at its end",
          file=stream)
    return 0
