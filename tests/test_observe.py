"""Watching a run (docs/training.md, "Watch a run"): TensorBoard and W&B beside
``metrics.jsonl``, ``--profile``'s traces and table, the dry run against the run, and runs
side by side in ``tpplan report``.

One Quickstart run (``plans/llama.yaml`` on 4 gloo processes, 2 × 2, three steps) with
every sink on and step 2 profiled serves the sink, profile and memory tests; two more runs
of the same plan (``pp 2 × tp 2``, and another seed) serve the comparison. Every
reference is independent of the code under test: the event files are read back with
tensorboard's own reader, the W&B run with wandb's own protobuf records, the collective
counts are the dry run's, the memory line is held against a dry run made here.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from helpers import PLANS, tpplan_cli
from trainrun import ok

PLAN = str(PLANS / "llama.yaml")
STEPS = 3
# The Quickstart's plan and sizes, three steps; no checkpoints (nothing here reads them).
QUICK = [f"train.steps={STEPS}", "checkpoint.enabled=false", "metrics.log_interval=1"]
SINKS = ["metrics.tensorboard=true", "metrics.wandb={project: tpplan-tests, mode: offline}"]
PP = ["mesh.pp=2", "pipeline={schedule: 1f1b}"]


def train(run_dir: Path, *sets: str, profile: str | None = None):
    args = ["train", "--plan", PLAN, "--nproc", "4"]
    for s in [*QUICK, f"metrics.run_dir={run_dir}", *sets]:
        args += ["--set", s]
    if profile:
        args += ["--profile", profile]
    proc = tpplan_cli(*args, env={"WANDB_SILENT": "true"}, timeout=300)
    ok(proc)
    return proc


@pytest.fixture(scope="module")
def watched(tmp_path_factory) -> tuple[Path, str]:
    run = tmp_path_factory.mktemp("watched") / "run"
    proc = train(run, *SINKS, profile="2:2")
    return run, proc.stdout


def rows(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def test_tensorboard_scalars_equal_metrics_jsonl(watched):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tpplan.train.sinks import tag

    run, out = watched
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    logged = rows(run)
    keys = {k for r in logged.values() for k, v in r.items()
            if k != "step" and isinstance(v, float)}
    assert {"loss", "grad_norm", "lr", "tokens_per_s", "tokens_per_s_per_device",
            "step_time_s"} <= keys
    for key in keys:
        got = {e.step: e.value for e in acc.Scalars(tag(key))}
        assert got == {s: f32(r[key]) for s, r in logged.items()}, key  # event files: float32
    assert {"plan/text_summary", "dry_run/text_summary"} <= set(acc.Tags()["tensors"])
    assert f"tensorboard --logdir {run / 'tensorboard'}" in out


def test_a_rows_event_is_a_mark_on_the_curves_axis_and_a_text_in_tensorboard(tmp_path):
    """A fault-tolerant run's fault / rejoin rows (``event`` in metrics.jsonl) reach
    TensorBoard as ``events/<event>`` = 1 at their step and as an ``events`` text; rows
    without one add nothing there. In process: the sink itself, read by tensorboard's reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import tpplan
    from tpplan.train.sinks import EVENTS, Sinks, tag

    metrics = tpplan.load(PLAN, [f"metrics.tensorboard={{dir: {tmp_path / 'tb'}}}"]).metrics
    sinks = Sinks(metrics, tmp_path, True, {})
    for step, event in [(1, None), (2, "fault"), (3, None), (4, "rejoin"), (5, "recovered")]:
        sinks.log({"step": step, "loss": 1.0 / step, "replicas": 1 if event == "fault" else 2,
                   **({"event": event} if event else {})})
    sinks.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    marks = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]
             if t.startswith(f"{EVENTS}/")}
    assert marks == {f"{EVENTS}/fault": [(2, 1.0)], f"{EVENTS}/rejoin": [(4, 1.0)],
                     f"{EVENTS}/recovered": [(5, 1.0)]}
    assert [e.step for e in acc.Scalars(tag("loss"))] == [1, 2, 3, 4, 5]
    assert sorted(e.step for e in acc.Tensors(f"{EVENTS}/text_summary")) == [2, 4, 5]


def test_wandb_offline_history_equals_metrics_jsonl(watched):
    import yaml
    from wandb_log import config, history

    from tpplan.train.sinks import tag

    run, _ = watched
    [log] = (run / "wandb").glob("offline-run-*/run-*.wandb")
    got, logged = history(log), rows(run)
    assert sorted(got) == sorted(logged)
    for step, row in logged.items():
        assert got[step] == {tag(k): v for k, v in row.items()
                             if k != "step" and isinstance(v, float)}, step  # exact: JSON doubles
    cfg = config(log)
    assert cfg["plan"] == yaml.safe_load((run / "plan.yaml").read_text())
    assert cfg["dry_run"]["dry_run"]["peak_bytes"] > 0


def test_profile_traces_per_rank_and_counts_equal_the_dry_run(watched):
    from tpplan.analysis import ANALYSES
    from tpplan.analysis.dryrun import dry_run

    run, out = watched
    for rank in range(4):
        trace = json.loads((run / "profile" / f"trace-rank{rank}.json").read_text())
        assert trace["distributedInfo"]["rank"] == rank
        names = {e.get("name") for e in trace["traceEvents"]}
        assert "tpplan.step 2" in names and any(n.startswith("gloo:") for n in names if n)
    predicted = dry_run(PLAN, 4, QUICK, [a for a in ANALYSES if a[0] == "comm_per_step"])
    expected: dict[str, int] = {}
    for r in predicted.extra["comm_per_step"]["collectives"]:
        key = f"{r['mesh_dim']} {r['kind']}"
        expected[key] = expected.get(key, 0) + r["count"]
    for rank in range(4):
        summary = json.loads((run / "profile" / f"summary-rank{rank}.json").read_text())
        [step] = summary["steps"]
        assert step["step"] == 2 and step["collectives"] == expected, rank
        assert step["compute_ms"] > 0 and set(step["collective_ms"]) >= {"tp", "dp_shard"}
    # On CUDA the profiler draws each annotation again on the GPU's timeline
    # (``gpu_user_annotation``, seen on an H200): the summary reads each step once.
    from tpplan.train.profiling import summarize
    trace = json.loads((run / "profile" / "trace-rank0.json").read_text())
    copies = [dict(e, cat="gpu_user_annotation", tid="stream 7") for e in trace["traceEvents"]
              if str(e.get("name", "")).startswith(("ProfilerStep#", "tpplan."))]
    assert copies
    doubled = dict(trace, traceEvents=trace["traceEvents"] + copies)
    assert summarize(doubled) == summarize(trace)
    assert "profile (rank 0" and "tp n / ms" in out and "CUDA only" in out
    assert all(r.get("profiled") == (s == 2) or (s != 2 and "profiled" not in r)
               for s, r in rows(run).items())


def test_profile_counts_under_a_pipeline_are_the_dry_runs_busiest_stage(other_runs):
    """pp 2 × tp 2: each stage issues its own collectives; the dry run counts the busiest
    rank's (the last stage: the loss-parallel head), so the largest count over the ranks of
    each kind equals it, p2p sends and receives included."""
    from tpplan.analysis import ANALYSES
    from tpplan.analysis.dryrun import dry_run

    pp = other_runs[0]
    predicted = dry_run(PLAN, 4, QUICK + PP, [a for a in ANALYSES if a[0] == "comm_per_step"])
    expected: dict[str, int] = {}
    for r in predicted.extra["comm_per_step"]["collectives"]:
        key = f"{r['mesh_dim']} {r['kind']}"
        expected[key] = expected.get(key, 0) + r["count"]
    counts = [json.loads((pp / "profile" / f"summary-rank{r}.json").read_text())["steps"][0]
              ["collectives"] for r in range(4)]
    assert {k: max(c.get(k, 0) for c in counts) for k in expected} == expected
    assert set().union(*counts) == set(expected) and expected["pp send"] > 0


def test_the_memory_line_is_within_tolerance_of_the_dry_run(watched):
    """The end-of-run line on CPU (docs/training.md says what it measures) against a dry
    run of the same plan made here."""
    from tpplan.analysis import ANALYSES
    from tpplan.analysis.dryrun import dry_run
    from tpplan.train.verdict import MEMORY_TOLERANCE

    run, out = watched
    peak = dry_run(PLAN, 4, QUICK, [a for a in ANALYSES if a[0] == "memory_per_rank"]) \
        .extra["memory_per_rank"]["peak"]
    record = json.loads((run / "estimate.json").read_text())
    assert record["dry_run"]["peak_bytes"] == peak
    measured = record["measured"]["peak_bytes"]
    assert MEMORY_TOLERANCE[0] <= measured / peak <= MEMORY_TOLERANCE[1], (measured, peak)
    assert record["memory_agrees"] is True
    assert f"{peak / 2 ** 20:.1f} MiB: measured ×{measured / peak:.2f}, within" in out
    flat = "".join(out.split())  # the summary table may wrap a long path
    assert "noestimateonCPU" in flat and f"│metrics│{run}/metrics.jsonl".replace(" ", "") in flat


def test_a_peak_too_small_for_the_cpu_resident_set_is_said_so_not_judged():
    """The README's MoE fine-tune predicts 1.9 MiB per rank, and its first step's resident set
    read ×1.93 of it (the tensors agree: tests/test_dry_run_vs_real.py): on CPU, under the
    floor the line gives the ratio with the reason it cannot judge it, and records no
    verdict; at the floor, and on CUDA (tensors alone) at any size, the ratio is judged."""
    from tpplan.train.verdict import CPU_MEMORY_FLOOR, MEMORY_TOLERANCE, compare_estimate

    mib = 2 ** 20
    small = compare_estimate({"peak_bytes": int(1.9 * mib)}, int(3.67 * mib), 0.1, 4, "cpu", "")
    line = small.rows["dry run's peak per rank"]
    assert line.startswith("1.9 MiB: measured ×1.93, too small to compare: under 24.0 MiB")
    assert "OUTSIDE" not in line and "within" not in line
    assert small.record["memory_agrees"] is None
    assert small.record["memory_floor_bytes"] == CPU_MEMORY_FLOOR
    for peak, measured, device in ((CPU_MEMORY_FLOOR, 2 * CPU_MEMORY_FLOOR, "cpu"),
                                   (2 * mib, 4 * mib, "cuda"), (2 * mib, 30 * mib, "cpu")):
        judged = compare_estimate({"peak_bytes": peak}, measured, 0.1, 4, device, "")
        assert judged.record["memory_agrees"] is False, (peak, measured, device)
        assert "OUTSIDE" in judged.rows["dry run's peak per rank"]
    fine = compare_estimate({"peak_bytes": 30 * mib}, 29 * mib, 0.1, 4, "cpu", "")
    assert fine.record["memory_agrees"] is True and MEMORY_TOLERANCE[0] < 29 / 30


@pytest.fixture(scope="module")
def other_runs(tmp_path_factory) -> tuple[Path, Path, Path]:
    """The watched run's plan as pp 2 × tp 2, with another seed, and once more as it was
    (without the sinks and the profile, which change no number)."""
    base = tmp_path_factory.mktemp("others")
    train(base / "pp2-tp2", *PP, profile="2:2")
    train(base / "seed1", "train.seed=1")
    train(base / "again")
    return base / "pp2-tp2", base / "seed1", base / "again"


def test_the_measured_step_starts_with_adamw_state_made_as_its_step_makes_it():
    """``memwatch`` makes AdamW's state before the step it measures on CPU (every later step,
    and the dry run's, holds it from the start): zero moments and step 0, as AdamW's first
    step makes them, so training is unchanged: three steps after it equal three without."""
    import copy

    import torch

    from tpplan.checkpoint.optim_state import init_state

    torch.manual_seed(0)
    lazy = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    early = copy.deepcopy(lazy)
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.1) for m in (lazy, early)]
    init_state(opts[1])
    state = opts[1].state
    assert len(state) == 4 and all(p.grad is None for p in early.parameters())
    assert all(not v.any() for s in state.values() for v in s.values())  # zeros, step 0
    x = torch.randn(5, 8)
    for model, opt in zip((lazy, early), opts):
        for _ in range(3):
            model(x).square().sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert all(torch.equal(a, b) for a, b in zip(lazy.parameters(), early.parameters()))


def test_the_memory_line_holds_for_the_pipeline_and_other_runs(other_runs):
    """The README's pipeline layout (pp 2 × tp 2) and a 2 × 2 run of another seed: the
    measured peak (the largest over the ranks) within tolerance of the dry run's."""
    from tpplan.train.verdict import MEMORY_TOLERANCE

    for run in other_runs[:2]:
        record = json.loads((run / "estimate.json").read_text())
        ratio = record["measured"]["peak_bytes"] / record["dry_run"]["peak_bytes"]
        assert MEMORY_TOLERANCE[0] <= ratio <= MEMORY_TOLERANCE[1], (run, ratio)


def test_one_runs_report_shows_the_dry_run_against_the_run(watched, tmp_path):
    from browser import browser_or_skip, parse, rendered_dom

    run, _ = watched
    page_file = tmp_path / "run.html"
    proc = tpplan_cli("report", run, "--html", page_file, check=True)
    record = json.loads((run / "estimate.json").read_text())
    assert "against the dry run's" in proc.stdout and f"{run / 'profile'}" in proc.stdout
    browser = browser_or_skip()
    p = parse(rendered_dom(browser, page_file)[0]).by_id("estimate")
    assert int(p.attrs["data-measured"]) == record["measured"]["peak_bytes"]
    assert int(p.attrs["data-predicted"]) == record["dry_run"]["peak_bytes"]


def test_calibrate_reads_a_run_folder(watched):
    """``--calibrate RUN_DIR``: the run's metrics.jsonl and plan.yaml, profiled steps left
    out; one run is fitted exactly."""
    run, _ = watched
    proc = tpplan_cli("validate", "--plan", run / "plan.yaml", "--world-size", "4", "--device",
                      "h100", "--calibrate", run, check=True)
    assert f"calibration: {run / 'metrics.jsonl'} (world size 4, 1 steps)" in proc.stdout
    assert "(1.000×)" in proc.stdout


def test_report_side_by_side_names_where_runs_part(watched, other_runs, tmp_path):
    """A 2 × 2 run and a pp 2 × tp 2 run of the same plan and seed agree to fp32 rounding;
    another seed parts at its first step; the page draws every curve (headless Chromium)."""
    from browser import browser_or_skip, parse, rendered_dom

    run, _ = watched
    pp, seed, _ = other_runs
    page_file = tmp_path / "runs.html"
    proc = tpplan_cli("report", run, pp, seed, "--json", "--html", page_file, check=True)
    data = json.loads(proc.stdout)
    [with_pp, with_seed] = data["partings"]
    assert with_pp["step"] is None and with_pp["common_steps"] == STEPS
    assert with_pp["tolerance"] == 1e-4 and with_pp["largest_relative"] > 0  # not bitwise
    assert with_seed["step"] == 1 and with_seed["relative"] > 1e-4
    diffs = {d["key"]: d["values"] for d in data["differences"]}
    assert diffs["mesh.pp"] == [None, 2, None] and diffs["train.seed"] == [0, 0, 1]
    assert diffs["mesh (at the run's world size)"][1]["pp"] == 2
    text = tpplan_cli("report", run, pp, seed, check=True).stdout
    assert f"{seed} against {run}: part at step 1" in text.replace("\n", "")
    browser = browser_or_skip()
    dom, log = rendered_dom(browser, page_file)
    page = parse(dom)
    assert page.find_all("body")[0].attrs.get("data-rendered") == "yes", \
        page.by_id("js-errors").text
    charts = {c.attrs["data-series"]: c for c in page.find_all("svg", **{"class": "chart"})}
    assert {"loss", "tokens_per_s", "grad_norm"} <= set(charts)
    lines = charts["loss"].find_all("polyline")
    assert [float(p.attrs["data-last"]) for p in lines] == \
        [r["metrics"][-1]["loss"] for r in data["runs"]]
    partings = {r.attrs["data-run"]: r.attrs["data-step"]
                for r in page.by_id("partings").find_all("tr") if "data-run" in r.attrs}
    assert partings == {str(pp): "none", str(seed): "1"}


def test_same_plan_same_seed_is_identical_at_tolerance_zero(watched, other_runs, tmp_path):
    """The default tolerance is 0 for runs of the same plan at the same world size: the
    run made again agrees bit for bit; one loss changed in its last bit parts there."""
    import math
    import shutil

    run, _ = watched
    again = other_runs[2]
    data = json.loads(tpplan_cli("report", run, again, "--json", check=True).stdout)
    assert data["differences"] == [] and data["partings"][0]["tolerance"] == 0
    assert data["partings"][0]["step"] is None and data["partings"][0]["common_steps"] == STEPS
    copy = tmp_path / "copy"
    shutil.copytree(again, copy)
    logged = rows(copy)
    logged[2]["loss"] = math.nextafter(logged[2]["loss"], math.inf)  # one bit apart
    (copy / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in logged.values()))
    data = json.loads(tpplan_cli("report", run, copy, "--json", check=True).stdout)
    assert data["partings"][0]["step"] == 2


def test_a_missing_sink_package_is_one_line_naming_the_extra(monkeypatch):
    import importlib.util

    import tpplan
    from tpplan.train import sinks

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    plan = tpplan.load(PLAN, ["metrics.tensorboard=true", "metrics.wandb={project: p}"])
    assert sinks.missing(plan.metrics) == (
        "metrics.wandb needs the 'wandb' package: pip install 'tpplan[wandb]' (or remove "
        "metrics.wandb from the plan)")


def test_metrics_section_mistakes_are_located(tmp_path):
    plan = tmp_path / "bad.yaml"
    plan.write_text(f"extends: {PLAN}\nmetrics:\n  tensorboard: {{dirr: x}}\n"
                    "  wandb: {mode: ofline}\n  profile: 4:2\n")
    proc = tpplan_cli("validate", "--plan", plan, "--world-size", "4")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    for needle in (f"{plan}:3:17: error: unknown key 'dirr' in 'metrics.tensorboard' (did you "
                   "mean 'dir'?)",
                   f"{plan}:4:17: error: 'metrics.wandb.mode' must be one of offline, online, "
                   "got 'ofline' (did you mean 'offline'?)",
                   f"{plan}:5:12: error: 'metrics.profile' must be START:END"):
        assert needle in proc.stdout + proc.stderr
    proc = tpplan_cli("train", "--plan", PLAN, "--set", "train.steps=3", "--profile", "2:5",
                      "--set", f"metrics.run_dir={tmp_path / 'run'}")
    assert proc.returncode == 1 and "metrics.profile 2:5 ends after the last step " \
        "(train.steps=3)" in proc.stderr and "Traceback" not in proc.stderr


def test_gpu_check_refuses_without_a_gpu_and_checks_its_arguments(tmp_path):
    """scripts/gpu_check.sh's parts that run without a GPU: its arguments, and the refusal
    (here nvidia-smi is kept off PATH, so it refuses also on a machine with a GPU)."""
    import os
    import shutil
    import subprocess

    from helpers import ROOT

    script = str(ROOT / "scripts" / "gpu_check.sh")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sed", "dirname", "cat", "grep"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path)}

    def run(*args):
        return subprocess.run([shutil.which("bash"), script, *args], capture_output=True,
                              text=True, env=env, timeout=30)

    bad = run("--steps", "3")
    assert bad.returncode == 2 and "--steps must be a whole number of at least 10" in bad.stderr
    unknown = run("--bogus")
    assert unknown.returncode == 2 and "unknown argument '--bogus'" in unknown.stderr
    assert run("--help").returncode == 0 and "fails loudly" in run("--help").stdout
    refused = run("--steps", "12", "--out", str(tmp_path / "out"))
    assert refused.returncode == 2 and "no NVIDIA GPU here (nvidia-smi not found)" in refused.stderr
    assert not (tmp_path / "out").exists()
