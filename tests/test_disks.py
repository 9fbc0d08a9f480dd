"""Disks that are full, read-only, or not folders, as a run meets them: on real filesystems.

A small tmpfs is mounted in a private mount namespace (``unshare``), so a disk really fills
up mid-save and a folder really is read-only (root ignores permission bits, a read-only
mount it cannot). The run goes on inside the namespace; what it left on the small disk is
copied out before the namespace ends, and checked here.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import cli_env
from trainrun import STEPS, assert_same_curve, fails, metrics, ok, tpplan_train, train_args

from tpplan import checkpoint as ckpt


def _unshare() -> list[str] | None:
    """A command prefix that may mount a tmpfs, or None where this machine allows none."""
    if shutil.which("unshare") is None:
        return None
    for prefix in (["unshare", "--user", "--map-root-user", "--mount"], ["unshare", "--mount"]):
        probe = subprocess.run([*prefix, "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                               capture_output=True)
        if probe.returncode == 0:
            return prefix
    return None


UNSHARE = _unshare()
needs_mounts = pytest.mark.skipif(UNSHARE is None, reason="needs a mount namespace (unshare)")


def _in_small_disk(tmp_path: Path, size_kib: int, args: list[str], options: str = "",
                   ) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """Run ``python -m tpplan ARGS`` with ``{disk}`` in ARGS on a fresh tmpfs of ``size_kib``;
    returns the run, and a copy of what the disk held at the end."""
    disk, kept = tmp_path / "disk", tmp_path / "disk-afterwards"
    disk.mkdir()
    kept.mkdir()
    cmd = " ".join(f"'{a}'" for a in [sys.executable, "-m", "tpplan", *args])
    cmd = cmd.replace("{disk}", str(disk))
    script = (f"mount -t tmpfs -o size={size_kib}k{options} tmpfs {disk} && "
              f"{{ {cmd}; rc=$?; cp -a {disk}/. {kept}/; exit $rc; }}")
    proc = subprocess.run([*UNSHARE, "bash", "-c", script], env=cli_env(), capture_output=True,
                          text=True, timeout=300)
    return proc, disk, kept


def _checkpoint_kib(reference_run: Path) -> int:
    folder = reference_run / "checkpoints" / f"step-{STEPS:06d}"
    return sum(p.stat().st_size for p in folder.iterdir()) // 1024


@needs_mounts
def test_disk_full_during_a_save_stops_every_rank_and_keeps_the_previous_checkpoint(
        reference_run, tmp_path):
    """Room for one and a half checkpoints: step 5 saves, step 10 fills the disk. Two ranks
    stop with one line, no ``.tmp`` is left, step 5 is intact and a resume from it (on a
    disk with room) ends on the reference curve."""
    d = tmp_path / "run"
    size = _checkpoint_kib(reference_run) * 3 // 2
    args = train_args(d, nproc=2, sets=["mesh.tp=1", "checkpoint.dir={disk}"])
    proc, disk, kept = _in_small_disk(tmp_path, size, args)
    out = fails(proc, "error: checkpoint of step 10 not saved: No space left on device",
                f"the previous checkpoint {disk}/step-000005 is intact")
    assert out.count("error:") == 1, out[-3000:]
    assert "room for fewer than the 2 more checkpoints" in out  # the preflight's warning
    assert sorted(p.name for p in kept.iterdir()) == ["step-000005"]
    assert ckpt.check_structure(kept / "step-000005")["step"] == 5
    assert ckpt.check_contents(kept / "step-000005") == []
    assert sorted(metrics(d)) == list(range(1, 11))
    ok(tpplan_train(d, "--resume", str(kept / "step-000005"), nproc=2,
                    sets=["mesh.tp=1", f"checkpoint.dir={tmp_path / 'roomy'}"]))
    assert_same_curve(metrics(d), metrics(reference_run), range(1, STEPS + 1))


@needs_mounts
def test_read_only_checkpoint_folder_is_found_before_step_one(tmp_path):
    d = tmp_path / "run"
    args = train_args(d, sets=["mesh.tp=1", "checkpoint.dir={disk}/ckpt"])
    proc, disk, _ = _in_small_disk(tmp_path, 1024, args, options=",ro")
    fails(proc, f"error: checkpoint folder {disk}/ckpt is not writable (Read-only file system)")
    assert not (d / "metrics.jsonl").exists()


@needs_mounts
def test_too_little_free_space_is_found_before_step_one(reference_run, tmp_path):
    d = tmp_path / "run"
    args = train_args(d, sets=["mesh.tp=1", "checkpoint.dir={disk}"])
    proc, disk, _ = _in_small_disk(tmp_path, _checkpoint_kib(reference_run) // 2, args)
    fails(proc, f"error: checkpoint folder {disk} has ", " free, one checkpoint needs ")
    assert not (d / "metrics.jsonl").exists()


def test_checkpoint_folder_that_is_a_file_is_found_before_step_one(tmp_path):
    d, f = tmp_path / "run", tmp_path / "a-file"
    f.write_text("not a folder")
    fails(tpplan_train(d, sets=["mesh.tp=1", f"checkpoint.dir={f}"]),
          f"error: checkpoint folder {f} is a file, not a folder")
    assert f.read_text() == "not a folder" and not (d / "metrics.jsonl").exists()
