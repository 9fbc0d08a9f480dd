"""``validate --device`` / ``--device-memory``: fits or not per rank, by how much, and the
changes that make a plan fit, each one checked by dry-running the plan again."""

from __future__ import annotations

import json

from helpers import PLANS

from tpplan.analysis import ANALYSES
from tpplan.analysis.dryrun import dry_run
from tpplan.analysis.memory.fit import ALLOCATOR_OVERHEAD, RUNTIME_RESERVE, needed
from tpplan.cli import main
from tpplan.plan.devices import DEVICES, parse_bytes

MEMORY = [a for a in ANALYSES if a[0] == "memory_per_rank"]

PLAN = str(PLANS / "llama.yaml")
SMALL = ["--set", "train.seq_len=64", "--set", "train.global_batch_size=16"]


def _validate(capsys, *args) -> dict:
    assert main(["validate", "--plan", PLAN, "--world-size", "4", *SMALL, *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_plan_that_fits_says_so_with_its_headroom(capsys):
    data = _validate(capsys, "--device", "h100")
    f, peak = data["fit"], data["memory_per_rank"]["peak"]
    assert f["fits"] and f["capacity"] == DEVICES["h100"].memory
    assert f["needed"] == int(peak * (1 + ALLOCATOR_OVERHEAD)) + RUNTIME_RESERVE
    assert f["headroom"] == f["capacity"] - f["needed"] > 0
    assert f["changes"] == []


def test_a_plan_that_does_not_fit_gets_changes_each_checked_by_a_dry_run(capsys):
    base = dry_run(PLAN, 4, [s for s in SMALL if s != "--set"], MEMORY)
    peak = base.extra["memory_per_rank"]["peak"]
    # A device just too small for the plan as written.
    data = _validate(capsys, "--device-memory", str(needed(peak) - 1))
    f = data["fit"]
    assert not f["fits"] and f["headroom"] == -1
    assert f["changes"], "no change was tried"
    for change in f["changes"]:
        if change["error"] is not None:
            continue
        again = dry_run(PLAN, 4, [s for s in SMALL if s != "--set"] + change["set"], MEMORY)
        assert change["peak"] == again.extra["memory_per_rank"]["peak"], change["change"]
        assert change["fits"] == (needed(change["peak"]) <= f["capacity"])
    assert f["fitting"] is not None and f["fitting"]["fits"]
    assert f["fitting"]["needed"] == min(c["needed"] for c in f["changes"] if c["fits"])


def test_under_a_pipeline_every_change_is_one_the_plan_accepts(capsys):
    """The micro-batch follows from ``pipeline.microbatches``: the changes halve it through
    them, and drop a ``train.micro_batch_size`` the plan also gives."""
    pipe = ["mesh={pp: 2, dp_replicate: 1, dp_shard: 2, tp: 1}", "train.micro_batch_size=2",
            "pipeline={schedule: 1f1b, microbatches: 4}"]
    base = dry_run(PLAN, 4, [s for s in SMALL if s != "--set"] + pipe, MEMORY)
    data = _validate(capsys, *sum((["--set", s] for s in pipe), []),
                     "--device-memory", str(needed(base.extra["memory_per_rank"]["peak"]) - 1))
    changes = {c["change"]: c for c in data["fit"]["changes"]}
    assert "micro-batch 1 (8 pipeline micro-batches)" in changes and "tp 2" in " ".join(changes)
    assert all(c["error"] is None for c in changes.values()), changes


def test_the_verdict_prints_what_it_assumed_and_by_how_much(capsys):
    assert main(["validate", "--plan", PLAN, "--world-size", "4", *SMALL,
                 "--device-memory", "1MiB"]) == 0
    out = capsys.readouterr().out
    assert "allocator overhead" in out and "CUDA context and NCCL (assumed)" in out
    assert "does not fit" in out and "short per rank" in out
    assert "changes, each checked by dry-running the plan again" in out


def test_device_mistakes_are_errors_with_the_nearest_name(capsys):
    assert main_exit(["validate", "--plan", PLAN, "--world-size", "4", "--device", "h10"]) == 2
    err = capsys.readouterr().err
    assert "no such preset" in err and "h100" in err
    assert main_exit(["validate", "--plan", PLAN, "--world-size", "4",
                      "--device-memory", "80 parsecs"]) == 2
    assert "80GiB" in capsys.readouterr().err
    assert parse_bytes("80GiB") == 80 * 2 ** 30 and parse_bytes("1.5 GB") == 1_500_000_000


def main_exit(argv) -> int:
    try:
        return main(argv)
    except SystemExit as e:
        return int(e.code)


def test_405b_on_4096_h100s_does_not_fit_and_a_checked_change_makes_it_fit(capsys):
    """The case the docs walk through: Llama 3.1 405B, tp 8, 4,096 ranks, one 8,192-token
    sequence per rank in fp32, against an H100."""
    from rich.console import Console

    from tpplan.commands.validate import render_fit

    argv = ["validate", "--plan", PLAN, "--world-size", "4096", "--set", "model.config=405b",
            "--set", "mesh.tp=8", "--set", "train.seq_len=8192",
            "--set", "train.global_batch_size=512", "--device", "h100", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    f = data["fit"]
    assert data["mesh"]["tp"] == 8 and data["world_size"] == 4096
    assert not f["fits"] and f["headroom"] == f["capacity"] - f["needed"] < 0
    assert f["needed"] == needed(data["memory_per_rank"]["peak"])
    fitting = f["fitting"]
    assert fitting is not None and fitting["fits"] and fitting["error"] is None
    assert fitting["needed"] <= DEVICES["h100"].memory
    # tp 16 cannot split 8 KV heads: said, not proposed.
    tp16 = next(c for c in f["changes"] if c["set"] == ["mesh.tp=16"])
    assert tp16["error"] and "8 heads" in tp16["error"] and not tp16["fits"]
    assert "use a tp that divides 8" in tp16["error"]  # the built-in Llama: no kv_colwise
    # No cp fits here: the one proposed needs least, as the next degree needs more (its ranks
    # come from dp_shard, so FSDP shards the state over fewer), not the largest degree tried.
    cp = next(c for c in f["changes"] if c["set"][0].startswith("mesh.cp="))
    degree = int(cp["set"][0].split("=")[1])
    memory = [a for a in ANALYSES if a[0] == "memory_per_rank"]
    sets = [a for a in argv[argv.index("--set"):argv.index("--device")] if a != "--set"]
    nxt = dry_run(PLAN, 4096, sets + cp["set"][1:] + [f"mesh.cp={2 * degree}"], memory, apply=False)
    assert not cp["fits"] and needed(nxt.extra["memory_per_rank"]["peak"]) > cp["needed"]
    out = Console(record=True, width=200)
    render_fit(out, f)
    text = out.export_text()
    assert "does not fit" in text and "short per rank" in text
    assert f"fits with {fitting['change']}" in text
