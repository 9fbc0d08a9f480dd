"""The dry run's figures for a run about to start: what ``tpplan train`` prints at its end
next to what it measured (:mod:`tpplan.train.verdict`).

The trainer cannot import this layer (``train`` and ``analysis`` sit on one row); the
command passes :func:`estimate` down to it, and the trainer calls it on rank 0 before its
process group starts (the dry run runs its own, fake one).
"""

from __future__ import annotations

from typing import Any, Sequence

from ...plan.devices import DEVICES, Device

__all__ = ["device_preset", "estimate"]


def device_preset(name: str) -> Device | None:
    """The preset of a CUDA device name (``NVIDIA H100 80GB HBM3`` -> ``h100``), or None."""
    n = name.upper()
    if "A100" in n:
        return DEVICES["a100-80gb" if "80G" in n else "a100-40gb"]
    for key in ("H200", "H100", "L40S"):
        if key in n:
            return DEVICES[key.lower()]
    return None


def estimate(plan_path: str, overrides: Sequence[str], world_size: int,
             device_type: str) -> dict[str, Any]:
    """``{peak_bytes, peak_at, step_time_s, device, step_time_note}`` of the plan at
    ``world_size``, or ``{error}`` when the dry run cannot size it: a run is never stopped
    by its estimate."""
    try:
        return _estimate(plan_path, overrides, world_size, device_type)
    except Exception as e:  # noqa: BLE001 -- the run goes on; the summary says why
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return {"error": f"{type(e).__name__}: {first}"}


def _estimate(plan_path: str, overrides: Sequence[str], world_size: int,
              device_type: str) -> dict[str, Any]:
    from ..analyses import ANALYSES
    from ..cost.step_time import estimate_step
    from ..dryrun import dry_run

    r = dry_run(plan_path, world_size, list(overrides), ANALYSES)
    if r.errors or "memory_per_rank" not in r.extra or "error" in r.extra["memory_per_rank"]:
        why = (r.errors[0].message if r.errors else r.analysis_errors[0].message
               if r.analysis_errors else "no memory analysis")
        return {"error": why}
    mem = r.extra["memory_per_rank"]
    out: dict[str, Any] = {"peak_bytes": mem["peak"], "peak_at": mem.get("peak_at"),
                           "at_peak": mem.get("at_peak"), "step_time_s": None, "device": None,
                           "mesh": r.resolution.dims.as_dict() if r.resolution else None}
    comm = r.extra.get("comm_per_step", {})
    if "collectives" in comm:  # per step: what `--profile`'s table counts
        counts: dict[str, int] = {}
        for c in comm["collectives"]:
            key = f"{c['mesh_dim']} {c['kind']}"
            counts[key] = counts.get(key, 0) + c["count"]
        out["collectives"] = counts
    if device_type != "cuda":
        out["step_time_note"] = ("no estimate on CPU: the cost model knows GPU presets "
                                 "(tpplan validate --device; --calibrate fits one to runs)")
        return out
    import torch

    name = torch.cuda.get_device_name()
    device = device_preset(name)
    if device is None:
        out["step_time_note"] = f"no device preset for {name} (plan/devices.py)"
        return out
    try:
        out["step_time_s"] = estimate_step(r, device).step_time
        out["device"] = device.name
    except ValueError as e:
        out["step_time_note"] = f"no estimate: {e}"
    return out
