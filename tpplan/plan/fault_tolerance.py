"""``fault_tolerance:`` — the section's spec and parser (docs/fault-tolerance.md).

The data-parallel replicas become torchft replica groups: each an ordinary tpplan job of
``dp_shard × cp × tp`` ranks under its own torchrun, agreeing on membership every step
through a lighthouse, so a group that dies is dropped and the others go on. Read here
without torch (and without torchft: whether the extra is installed is the trainer's check).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import ErrorList, Loc
from .reader import Reader
from .yamlio import LMap

__all__ = ["FT_EXTRA", "FaultToleranceSpec", "check_fault_tolerance", "fault_tolerance_section",
           "parse_fault_tolerance"]

FT_EXTRA = "tpplan[ft]"  # what `pip install` needs for a plan with this section
# The mesh axes a replica group may hold; the others are refused at their key.
COMPOSES = ("dp_shard", "cp", "tp")
KEYS = ("replica_groups", "min_replicas", "lighthouse", "timeout_s", "join_timeout_s",
        "heartbeat_timeout_s")


@dataclass
class FaultToleranceSpec:
    """``fault_tolerance:`` — ``replica_groups`` torchft replica groups (the ``dp_replicate``
    dimension; at least 2), a step committed when ``min_replicas`` of them take part.

    ``lighthouse``: its address (``http://host:29510``, a lighthouse started by ``tpplan
    lighthouse``); null: ``tpplan train`` starts one on this machine. ``timeout_s``: how long
    a cross-group collective or a weights transfer may take before its group is dropped.
    ``join_timeout_s`` / ``heartbeat_timeout_s``: the local lighthouse's wait for a group
    that is alive but late, and the silence after which a group counts as dead."""

    replica_groups: int = 2
    min_replicas: int = 1
    lighthouse: str | None = None
    timeout_s: float = 30.0
    join_timeout_s: float = 5.0
    heartbeat_timeout_s: float = 2.0
    loc: Loc | None = None
    locs: dict[str, Loc] = field(default_factory=dict)

    def where(self, key: str) -> Loc | None:
        return self.locs.get(key, self.loc)


def parse_fault_tolerance(doc: LMap, errs: ErrorList) -> FaultToleranceSpec | None:
    """``fault_tolerance: {replica_groups: 2, min_replicas: 1, lighthouse: null, ...}``;
    None when the plan has no such section."""
    key = "fault_tolerance"
    if key not in doc:
        return None
    r = Reader.section(errs, doc, key, KEYS)
    d = FaultToleranceSpec()
    spec = FaultToleranceSpec(
        replica_groups=r.get("replica_groups", int, d.replica_groups),
        min_replicas=r.get("min_replicas", int, d.min_replicas),
        lighthouse=r.get("lighthouse", str, None),
        timeout_s=r.number("timeout_s", d.timeout_s),
        join_timeout_s=r.number("join_timeout_s", d.join_timeout_s),
        heartbeat_timeout_s=r.number("heartbeat_timeout_s", d.heartbeat_timeout_s),
        loc=doc.key_loc(key), locs=r.locs())
    r.at_least("replica_groups", spec.replica_groups, 2)
    r.at_least("min_replicas", spec.min_replicas, 1)
    for k in ("timeout_s", "join_timeout_s", "heartbeat_timeout_s"):
        if getattr(spec, k) <= 0:
            errs.add(f"'fault_tolerance.{k}' must be positive, got {getattr(spec, k)}", r.loc(k))
    if spec.min_replicas > spec.replica_groups:
        errs.add(f"'fault_tolerance.min_replicas' is {spec.min_replicas}, more than the "
                 f"{spec.replica_groups} replica groups: no step could ever commit",
                 r.loc("min_replicas"))
    if spec.lighthouse is not None and not spec.lighthouse.startswith(("http://", "https://")):
        errs.add(f"'fault_tolerance.lighthouse' must be an address like http://host:29510 (or "
                 f"null: tpplan train starts one), got '{spec.lighthouse}'", r.loc("lighthouse"))
    return spec


def check_fault_tolerance(spec: FaultToleranceSpec | None, mesh, errs: ErrorList) -> None:
    """What a replica group may hold: ``dp_shard``, ``cp`` and ``tp`` compose (the groups
    all-reduce their sharded gradients rank by rank); pipeline stages and expert parallelism
    do not yet (their gradients and clipping take other groups), refused at their key.
    ``mesh.dp_replicate`` is the replica groups: 1 (left to the section) or the same number."""
    if spec is None:
        return
    if mesh.dp_replicate not in (1, spec.replica_groups):
        errs.add(f"'mesh.dp_replicate' is {mesh.dp_replicate} but fault_tolerance.replica_groups "
                 f"is {spec.replica_groups}: under fault tolerance the replica groups are the "
                 f"dp_replicate dimension; leave dp_replicate at 1 or make them equal",
                 mesh.locs.get("dp_replicate", mesh.loc))
    for axis in ("pp", "ep"):
        if getattr(mesh, axis) > 1:
            errs.add(f"fault_tolerance does not compose with mesh.{axis}={getattr(mesh, axis)} yet "
                     f"(a replica group may hold {', '.join(COMPOSES)}); set mesh.{axis}=1 or "
                     f"remove the fault_tolerance section", mesh.locs.get(axis, mesh.loc))


def fault_tolerance_section(doc: LMap, mesh, errs: ErrorList) -> FaultToleranceSpec | None:
    """The section parsed and checked against the plan's mesh (what ``parse_plan`` calls)."""
    spec = parse_fault_tolerance(doc, errs)
    check_fault_tolerance(spec, mesh, errs)
    return spec
