"""One replica group's side of a fault-tolerant run: torchft's Manager around the trainer's step.

Each step: a quorum with the lighthouse (a group that restarted takes the current weights,
optimizer state and schedule from a live peer here, before its forward); the group's own
forward and backward (FSDP2 reduce-scatters inside the group as always); one all-reduce of
the sharded gradients, the loss and the trained-target count across the groups in the quorum,
rank by rank (rank r of each group holds the same shards); the optimizer step only when the
quorum agrees (``should_commit``). A group that fails mid-step makes the others' step not
commit; they run the same step again without it, so no step number is skipped.

The loss is the mean over the targets actually trained: each group's loss is its targets'
sum over the *global* count ``C`` (what a run without fault tolerance computes); the groups'
sums are added, and loss and gradients rescaled by ``C / T`` for the ``T`` targets the
participating groups trained (exactly 1 when every group takes part).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..plan.errors import CommandError
from .groups import ENV_LIGHTHOUSE, ENV_START

__all__ = ["Replica"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _tree_to_local(value: Any) -> Any:
    """An optimizer state dict with each DTensor replaced by ``("dtensor", its local shard)``:
    the peer holding the same shards rebuilds it on its own mesh."""
    if isinstance(value, DTensor):
        return ("dtensor", value.to_local().detach().clone())
    if isinstance(value, dict):
        return {k: _tree_to_local(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_tree_to_local(v) for v in value]
    return value


def _optimizer_from_local(optimizer: torch.optim.Optimizer, sent: dict) -> dict:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for index, entries in sent["state"].items():
        p = params[int(index)]
        state[index] = {k: DTensor.from_local(v[1].to(_local(p).device), p.device_mesh, p.placements,
                                              run_check=False, shape=p.shape, stride=p.stride())
                        if isinstance(v, tuple) and v and v[0] == "dtensor" else v
                        for k, v in entries.items()}
    return {"state": state, "param_groups": sent["param_groups"]}


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__


def _store() -> tuple[Any, str, int]:
    """A TCPStore of this launch round for the Manager (torchrun's keeps keys across restarts,
    where a stale manager address would be read): rank 0 serves it, the group learns where."""
    store, where = None, [None, None]
    if dist.get_rank() == 0:
        host = os.environ.get("MASTER_ADDR", "localhost")
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        where = [host, store.port]
    dist.broadcast_object_list(where, src=0)
    return store, where[0], int(where[1])


class Replica:
    """This rank's link to the other replica groups (torchft's Manager and process group)."""

    def __init__(self, spec, group: int, trainee, device_type: str, note: Callable[[str], None]):
        import logging
        import warnings

        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        # torchft logs every reconfiguration and each failed collective's traceback; the
        # trainer says a fault, a rejoin and a recovery in one line each instead
        logging.getLogger("torchft.manager").setLevel(logging.CRITICAL)
        # a received state dict is read from a read-only buffer and copied into the weights
        warnings.filterwarnings("ignore", message="The given buffer is not writable")

        self.spec, self.group, self.trainee, self.note = spec, group, trainee, note
        self.healed_at: int | None = None  # the step a transfer from a peer brought us to
        self.participants = self.logged = spec.replica_groups
        self.members: list[int] = []  # the groups whose gradients the last all-reduce added
        self.checkpoints = None  # the run's checkpoint folder when this group may write it
        self.waited = 0.0  # seconds in quorums and failed tries since the last committed step
        self.tried: float | None = None  # when the current try of a step started
        # step -> the step of the run's newest checkpoint at or past it, taken (None: none);
        # asked at a quorum without every group (tpplan.train.replicated.catch_up)
        self.catch_up: Callable[[int], int | None] | None = None
        timeout = timedelta(seconds=spec.timeout_s)
        pg = ProcessGroupNCCL(timeout=timeout) if device_type == "cuda" else ProcessGroupGloo(timeout=timeout)
        self._store, host, port = _store()
        self.manager = Manager(
            pg=pg, load_state_dict=self.load, state_dict=self._state, min_replica_size=spec.min_replicas,
            use_async_quorum=False, timeout=timeout, quorum_timeout=timeout * 4, connect_timeout=timeout,
            rank=dist.get_rank(), world_size=dist.get_world_size(), store_addr=host, store_port=port,
            replica_id=f"tpplan_{group}", init_sync=False)
        self._meet()

    def _meet(self) -> None:
        """Rank 0 of a group's first round waits (up to ``timeout_s``) until every group's
        Manager is up, so the lighthouse holds the first quorum for all of them."""
        where = os.environ.get(ENV_START)
        if not where or dist.get_rank() or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return
        host, port = where.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=self.spec.timeout_s))
        store.add("started", 1)
        deadline = time.monotonic() + self.spec.timeout_s
        while store.add("started", 0) < self.spec.replica_groups and time.monotonic() < deadline:
            time.sleep(0.05)

    def start_at(self, step: int) -> None:
        """The step this group resumes after (a checkpoint's), before the first quorum."""
        self.manager.load_state_dict({"step": step, "batches_committed": step})

    def next_step(self) -> int | None:
        """A quorum for the next step (recovering from a peer if this group is behind); the
        step's number. None when the run went on past it without this group and this group
        took the run's newest checkpoint instead (:attr:`catch_up`): this try of the step is
        dropped, and the next quorum is from that checkpoint's step."""
        t0 = time.perf_counter()
        if self.tried is not None:  # the last try of a step did not commit: its time is lost
            self.waited += t0 - self.tried
        try:
            self.manager.start_quorum()
        except (RuntimeError, TimeoutError) as e:  # the lighthouse gone: torchft's Rust error
            why = f"no answer in {self.spec.timeout_s * 4:g} s" if isinstance(e, TimeoutError) else _first_line(e)
            raise CommandError(f"replica group {self.group}: no quorum from the lighthouse "
                               f"{os.environ.get(ENV_LIGHTHOUSE, '')} ({why}); start it again "
                               f"(tpplan lighthouse), then the groups: they resume from the last "
                               f"checkpoint") from None
        self.tried = time.perf_counter()
        self.waited += self.tried - t0  # quorum, reconfiguration, recovery
        self.participants = self.manager.num_participants()
        step = self.manager.current_step() + 1
        if self.participants < self.spec.replica_groups and self.catch_up is not None:
            at = self.catch_up(step)
            if at is not None:
                self.manager.report_error(RuntimeError(f"the run is at step {at}"))
                self.manager.should_commit()  # False on every rank of the group: nothing applied
                self.manager.load_state_dict({"step": at, "batches_committed": at})
                self.healed_at = self.tried = None
                self.logged = self.participants  # no fault said at the next commit: it is not one
                return None
        return step

    def event(self, step: int) -> str | None:
        """The committed ``step``'s event for metrics.jsonl, against the last committed step's
        groups: a fault, a rejoin, or this group's recovery from a peer; each said in one line.
        Said at the commit, not at the quorum: a try that a second fault undid (a group dying
        while it recovers) changes nothing the run keeps, so it says nothing."""
        before, self.logged = self.logged, self.participants
        groups = self.spec.replica_groups
        if self.healed_at is not None:
            self.note(f"replica group {self.group}: recovered weights and optimizer state from a "
                      f"live peer at step {self.healed_at}; rejoined ({self.participants} of {groups} "
                      f"replica groups)")
            self.healed_at = None
            return "recovered"
        if self.participants < before:
            self.note(f"fault: {before - self.participants} replica group(s) lost at step {step}; "
                      f"{self.participants} of {groups} go on")
            return "fault"
        if self.participants > before:
            self.note(f"rejoin: {self.participants} of {groups} replica groups from step {step}")
            return "rejoin"
        return None

    def data_place(self, dp_rank: int, dp: int) -> tuple[int, int]:
        """(data-parallel rank, degree) of this rank over every group's ranks: the global batch
        is a pure function of (seed, step), each group trains its own fixed share."""
        return self.group * dp + dp_rank, self.spec.replica_groups * dp

    def reduce(self, loss_sum: float, trained: int, count: int) -> tuple[float, int] | None:
        """Add the groups' gradients, losses and trained targets; rescale to the mean over what
        was trained. None when a group failed mid-way (the step will not commit). A one-hot of
        this group's index rides along: the sum names the groups in the step (:meth:`saves`)."""
        groups = self.spec.replica_groups
        grads = [_local(p.grad) for p in self.trainee.trained if p.grad is not None]
        tail = torch.zeros(2 + groups, dtype=torch.float32, device=grads[0].device if grads else "cpu")
        tail[0], tail[1], tail[2 + self.group] = loss_sum, float(trained), 1.0
        flat = torch.cat([g.reshape(-1).float() for g in grads] + [tail])
        from torch.distributed import ReduceOp

        self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
        if self.manager.errored() is not None:
            return None
        tail = flat[-groups - 2:].tolist()
        self.members = [g for g in range(groups) if tail[2 + g] > 0.5]
        total = int(round(tail[1]))
        scale = count / total if total else 0.0
        offset = 0
        for g in grads:
            n = g.numel()
            part = flat[offset:offset + n].view_as(g)
            g.copy_(part * scale if scale != 1.0 else part)
            offset += n
        return tail[0] * scale, total

    def commit(self) -> bool:
        """Whether every group's ranks agree to take this step's optimizer update."""
        committed = self.manager.should_commit()
        if committed:
            self.tried = None
        return committed

    def digest(self) -> str:
        """SHA-256 of this rank's shards of the weights: the same rank of every group holds
        the same shards, so equal digests say the groups' weights are bit-identical."""
        import hashlib

        h = hashlib.sha256()
        for part in self.trainee.parts:
            for p in part.parameters():
                h.update(_local(p).detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()[:16]

    def saves(self) -> bool:
        """Whether this group writes the committed step's checkpoint: the lowest-numbered group
        whose gradients the step added. Every group of the step read the same sum, so exactly
        one of them writes, whichever groups are down (group 0 when it takes part)."""
        return bool(self.members) and self.members[0] == self.group

    def close(self) -> None:
        self.manager.shutdown(wait=False)

    def _state(self) -> dict:
        """What a recovering peer takes from this group: weights, optimizer state, schedule."""
        t = self.trainee
        return {"parts": [{n: _local(p).detach().clone() for n, p in part.named_parameters()}
                          for part in t.parts],
                "optimizers": [_tree_to_local(o.state_dict()) for o in t.optimizers],
                "schedule": t.schedules[0].state_dict(), "rng": torch.get_rng_state()}

    def load(self, sent: dict) -> None:
        """Take what a live peer sent (:meth:`_state`): the Manager calls it at the quorum of a
        group that is behind, before the step's forward."""
        t = self.trainee
        with torch.no_grad():
            for part, weights in zip(t.parts, sent["parts"]):
                for name, p in part.named_parameters():
                    local = _local(p)
                    local.copy_(weights[name].to(local.device))
        for optimizer, state in zip(t.optimizers, sent["optimizers"]):
            optimizer.load_state_dict(_optimizer_from_local(optimizer, state))
        for schedule in t.schedules:
            schedule.load_state_dict(sent["schedule"])
        torch.set_rng_state(sent["rng"])
        self.healed_at = self.manager.current_step()
