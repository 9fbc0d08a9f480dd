"""``python tests/hooked.py ARGS``: ``python -m tpplan ARGS`` with test hooks installed, each
switched on by one environment variable (off when it is unset).

They make real failures happen at a chosen moment -- a worker killed by SIGKILL, every rank
dying between a checkpoint's shards and its completion, a step slow enough to be
interrupted, a checkpoint's file damaged on disk --, put replica groups' events in a set
order (a survivor that waits for a restarted group to ask for its quorum, a restarted group
held back until a checkpoint exists), record what a run did (each batch's digest), or do
the wrong thing on purpose (experts sharded without dispatch, which ``tpplan verify`` must
catch), so tests can assert what a user sees. Nothing is simulated: the kill is a real
``SIGKILL`` of the real process.

Each hook replaces a public product function in the process it runs in: the training loop's
seams (:mod:`tpplan.train.hooks`), the checkpoint's hashing of its shards (called once the
shards are written, before the checkpoint is completed), a replica group's quorum and
its joining (``Replica.next_step``, the loop's ``join_replicas``), ``expert_parallel``'s
``routed_forward``. They reach every process of a run: the workers ``--nproc`` starts run
this script too (:data:`tpplan.commands.train.WORKER_COMMAND`), and the ranks ``tpplan
verify`` spawns install them before they start (:class:`InRanks`). ``helpers.tpplan_command``
runs tpplan through here when a test's environment sets one of :data:`HOOKS`; a test in
this process calls :func:`install` with ``monkeypatch.setattr``.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

# "RANK:STEP": SIGKILL that rank after that step, once; "RANK:recovery": in a replica group's
# first restart, SIGKILL it while it takes the weights from a live peer; several, comma-separated
KILL_AT = "TPPLAN_TEST_KILL_AT"
SLOW_STEP = "TPPLAN_TEST_STEP_SLEEP_S"  # seconds every step sleeps at its end
RECORD_BATCHES = "TPPLAN_TEST_RECORD_BATCHES"  # "1": <run_dir>/batches/rank<R>.jsonl, a digest per step
DIE_DURING_SAVE = "TPPLAN_TEST_DIE_DURING_SAVE"  # "STEP": every rank exits 17 in that step's save
NO_DISPATCH = "TPPLAN_TEST_EP_NO_DISPATCH"  # "1": each rank runs only its own experts' tokens
KILL_PREPARE = "TPPLAN_TEST_KILL_PREPARE_AFTER"  # "N": SIGKILL `data prepare` after its N-th shard
# Replica groups' order of events, made certain instead of left to timing:
MARKS = "TPPLAN_TEST_MARKS"  # a folder: a restarted group's ranks touch group<G>-restart<N> there at their first quorum
AWAIT = "TPPLAN_TEST_AWAIT"  # "STEP:NAME,...": a rank waits after STEP (a launch's first round) until MARKS/NAME exists
HOLD = "TPPLAN_TEST_HOLD"  # "G:PATH": group G's restarted ranks wait until PATH exists before they join the groups
DAMAGE = "TPPLAN_TEST_DAMAGE"  # "RANK:STEP:PATH": after STEP (first round), that rank flips a byte in the file PATH
HOOKS = (KILL_AT, SLOW_STEP, RECORD_BATCHES, DIE_DURING_SAVE, NO_DISPATCH, KILL_PREPARE, MARKS, AWAIT, HOLD, DAMAGE)
WAIT_S = 240  # the longest AWAIT and HOLD wait: then the run goes on, and the test fails on what it did
HERE = Path(__file__).resolve()


def install(env: Mapping[str, str], put: Callable[[Any, str, Any], None] = setattr) -> None:
    """Install in this process every hook ``env`` switches on, and make the processes it
    starts install them too; ``put`` sets an attribute (``monkeypatch.setattr`` undoes it)."""
    on = {name: env[name] for name in HOOKS if env.get(name)}
    if not on:
        return
    if KILL_AT in on or SLOW_STEP in on or AWAIT in on or DAMAGE in on or RECORD_BATCHES in on:
        from tpplan.train import hooks

        if KILL_AT in on or SLOW_STEP in on or AWAIT in on or DAMAGE in on:
            put(hooks, "after_step", _after_step(on, hooks.after_step))
        if any(k.endswith(":recovery") for k in on.get(KILL_AT, "").split(",")):
            from tpplan.ft.replica import Replica

            put(Replica, "load", _kill_in_recovery(on[KILL_AT].split(","), Replica.load))
        if RECORD_BATCHES in on:
            put(hooks, "batch_recorder", _record_batches)
    if MARKS in on:
        from tpplan.ft.replica import Replica

        put(Replica, "next_step", _marking(Path(on[MARKS]), Replica.next_step))
    if HOLD in on:
        from tpplan.train import loop

        put(loop, "join_replicas", _holding(on[HOLD], loop.join_replicas))
    if DIE_DURING_SAVE in on:
        from tpplan.checkpoint import sharded

        put(sharded, "hash_files", _die_in_save(int(on[DIE_DURING_SAVE]), sharded.hash_files))
    if NO_DISPATCH in on:
        from tpplan.analysis.verify import numerics
        from tpplan.parallel.experts import style

        put(style, "routed_forward", _without_dispatch)
        put(numerics, "spawn", _spawning(numerics.spawn, on))
    if KILL_PREPARE in on:
        from tpplan.data import prepare

        put(prepare, "write_shard", _kill_after_shards(int(on[KILL_PREPARE]), prepare.write_shard))
    from tpplan.commands import train

    put(train, "WORKER_COMMAND", [str(HERE)])
    put(train, "WORKER_ENTRY", InRanks(train.run_worker, on))


class InRanks:
    """A spawned rank's function with ``hooks`` (name -> value) installed first; picklable,
    so the ranks find it by this module's name."""

    def __init__(self, fn: Callable, hooks: dict[str, str]) -> None:
        self.fn, self.hooks = fn, hooks
        # torchrun's agent names its entrypoint by these (a function's)
        self.__name__ = self.__qualname__ = getattr(fn, "__qualname__", type(self).__name__)

    def __call__(self, *args: Any) -> Any:
        install(self.hooks)
        return self.fn(*args)


def _spawning(spawn: Callable, hooks: dict[str, str]) -> Callable:
    def spawn_hooked(fn: Callable, world_size: int, *args: Any) -> None:
        return spawn(InRanks(fn, hooks), world_size, *args)
    return spawn_hooked


def _restart_round() -> str:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _after_step(on: dict[str, str], then: Callable[[int, int], None]) -> Callable[[int, int], None]:
    waits = dict(spec.split(":", 1) for spec in on[AWAIT].split(",")) if AWAIT in on else {}
    damage = on[DAMAGE].split(":", 2) if DAMAGE in on else None

    def after_step(rank: int, step: int) -> None:
        then(rank, step)
        if SLOW_STEP in on:
            time.sleep(float(on[SLOW_STEP]))
        # Only in the first round of a launch: the restarted workers must run on.
        if _restart_round() != "0":
            return
        if str(step) in waits:
            _wait_for(Path(on.get(MARKS, ".")) / waits[str(step)])
        if damage is not None and damage[:2] == [str(rank), str(step)]:
            _flip_a_byte(Path(damage[2]))
        if f"{rank}:{step}" in on.get(KILL_AT, "").split(","):
            os.kill(os.getpid(), signal.SIGKILL)
    return after_step


def _flip_a_byte(path: Path) -> None:
    """Damage on disk that keeps the file's size: only its SHA-256 can tell."""
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def _marking(folder: Path, next_step: Callable) -> Callable:
    """``Replica.next_step`` that, at a restarted group's first quorum, says so in ``folder``
    (``group<G>-restart<N>``) just before it asks for the quorum."""
    asked: list[bool] = []

    def next_step_marked(replica: Any) -> Any:
        if not asked:
            asked.append(True)
            if _restart_round() != "0":
                folder.mkdir(parents=True, exist_ok=True)
                (folder / f"group{replica.group}-restart{_restart_round()}").touch()
        return next_step(replica)
    return next_step_marked


def _holding(spec: str, join_replicas: Callable) -> Callable:
    """The training loop's ``join_replicas`` that keeps a restarted group (its checkpoint
    already read) away from the others until a path exists: a group back late."""
    group, path = spec.split(":", 1)

    def join_held(prep: Any, *args: Any) -> Any:
        from tpplan.ft.groups import group_index

        if group_index() == int(group) and _restart_round() != "0":
            _wait_for(Path(path))
        return join_replicas(prep, *args)
    return join_held


def _kill_in_recovery(kills: list[str], load: Callable) -> Callable:
    """``Replica.load`` that SIGKILLs this rank, in its group's first restart, when a live
    peer's weights have arrived and before they are applied: a second fault mid-recovery."""
    def load_or_die(replica: Any, sent: dict) -> None:
        import torch.distributed as dist

        rank = replica.group * dist.get_world_size() + dist.get_rank()
        if f"{rank}:recovery" in kills and _restart_round() == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        load(replica, sent)
    return load_or_die


def _record_batches(run_dir: Path, rank: int, dp_rank: int, tp_rank: int) -> Callable:
    folder = run_dir / "batches"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank{rank}.jsonl"

    def record(step: int, batch) -> None:  # noqa: ANN001 - the step's tokens
        digest = hashlib.sha256(batch.numpy().tobytes()).hexdigest()[:16]
        with open(path, "a") as out:
            out.write(json.dumps({"step": step, "dp_rank": dp_rank, "tp_rank": tp_rank,
                                  "digest": digest}) + "\n")
    return record


def _kill_after_shards(n: int, write_shard: Callable) -> Callable:
    """``data prepare``'s shard writer, which SIGKILLs its process once ``n`` shards are
    whole: a prepare killed half-way (run it with ``--workers 1``: the shards are written in
    this process)."""
    done = []

    def write_then_die(*args: Any, **kwargs: Any) -> dict:
        meta = write_shard(*args, **kwargs)
        done.append(meta)
        if len(done) >= n:
            os.kill(os.getpid(), signal.SIGKILL)
        return meta
    return write_then_die


def _die_in_save(step: int, hash_files: Callable) -> Callable:
    """The shards' hashing, which exits at once (17) in the save of ``step``: a kill after
    DCP wrote the shards, before the checkpoint is complete."""
    def hash_or_die(folder: Path, names: list[str]) -> dict:
        if Path(folder).name == f"step-{step:06d}.tmp":
            os._exit(17)
        return hash_files(folder, names)
    return hash_or_die


def _without_dispatch(module, forward, mesh, num_experts: int, hidden_states, top_k_index,  # noqa: ANN001
                      top_k_weights, *args, **kwargs):
    """The wrong thing on purpose: each rank runs only the tokens its own experts were
    chosen for, and the remote experts' tokens are dropped."""
    import torch

    from tpplan.parallel.experts.forms import using_local_experts
    from tpplan.parallel.experts.style import dispatch_counts

    dispatch_counts(top_k_index, num_experts)  # ids checked as the dispatch checks them
    local = num_experts // mesh.size()
    first = mesh.get_local_rank() * local
    mine = (top_k_index >= first) & (top_k_index < first + local)
    ids = torch.where(mine, top_k_index - first, local)  # local: transformers' "no expert"
    with using_local_experts(module, list(module._tpplan_ep_params), 1):
        try:
            module.num_experts = local
            return forward(hidden_states, ids, top_k_weights * mine)
        finally:
            module.num_experts = num_experts


if __name__ == "__main__":
    import hooked  # this file by its module name: what InRanks pickles is found by that name

    hooked.install(os.environ)
    from tpplan.cli import main

    sys.exit(main())
