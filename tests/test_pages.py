"""The pages, rendered by a real headless Chromium: ``validate --html`` and ``report --html``
hold the numbers ``--json`` prints, log no JavaScript error, and look right (screenshot).

Skipped only when no Chromium can be found at all; CI installs one and sets
``TPPLAN_REQUIRE_BROWSER=1``, which turns the skip into a failure."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from browser import browser_or_skip, parse, rendered_dom, screenshot
from helpers import PLANS, tpplan_cli

PLAN = str(PLANS / "llama.yaml")
SHOTS = os.environ.get("TPPLAN_SCREENSHOTS")  # a folder to keep the screenshots in


@pytest.fixture(scope="module")
def browser() -> str:
    return browser_or_skip()


def size(n: float) -> str:
    """Bytes as the terminal and the page print them (docs/dry-run.md): 1.50 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _clean(dom: str, log: str):
    page = parse(dom)
    body = page.find_all("body")[0]
    errors = page.by_id("js-errors")
    assert body.attrs.get("data-rendered") == "yes", errors.text
    assert errors.text == "" and "hidden" in errors.attrs
    assert "Uncaught" not in log and "SyntaxError" not in log, log[-2000:]
    return page


def _keep(shot: Path, name: str) -> None:
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(SHOTS) / name)


def test_the_validate_page_holds_the_json_numbers(browser, tmp_path):
    page_file = tmp_path / "plan.html"
    args = ["validate", "--plan", PLAN, "--world-size", "8", "--set", "train.seq_len=64",
            "--set", "train.global_batch_size=16", "--device-memory", "4MiB"]
    proc = tpplan_cli(*args, "--json", "--html", page_file, check=True)
    data = json.loads(proc.stdout)
    page = _clean(*rendered_dom(browser, page_file))

    # The mesh: one cell per rank, each at its coordinates, coloured by tp groups.
    mesh = page.by_id("mesh")
    dims = data["mesh"]
    assert mesh.attrs["data-shape"] == f"{dims['dp_replicate']},{dims['dp_shard']},{dims['tp']}"
    cells = mesh.find_all("div", **{"class": "rank"})
    assert [int(c.attrs["data-rank"]) for c in cells] == list(range(data["world_size"]))
    for c in cells:
        r = int(c.attrs["data-rank"])
        assert (int(c.attrs["data-dp_shard"]), int(c.attrs["data-tp"])) == \
            ((r // dims["tp"]) % dims["dp_shard"], r % dims["tp"])
    tp_groups = {c.attrs["data-group"] for c in cells}
    assert len(tp_groups) == data["world_size"] // dims["tp"]

    # The module table: every module row of the JSON, collapsed over the blocks.
    rows = page.by_id("modules").find_all("tr")
    counted = sum(int(r.attrs["data-count"]) for r in rows if "data-count" in r.attrs)
    assert counted == len(data["modules"])
    wq = next(r for r in rows if r.attrs.get("data-path") == "layers.*.attention.wq")
    first_wq = next(m for m in data["modules"] if m["path"] == "layers.0.attention.wq")
    p = first_wq["params"][0]
    assert f"({', '.join(map(str, p['local_shape']))})" in wq.text and first_wq["rule"] in wq.text

    # Memory: the stacked bars and the table hold the JSON's bytes, against the capacity.
    mem = data["memory_per_rank"]
    bar = page.find_all("g", **{"data-bar": "peak"})[0]
    parts = {r.attrs["data-part"]: int(r.attrs["data-bytes"]) for r in bar.find_all("rect")}
    assert {k: parts[k] for k in mem["at_peak"]} == mem["at_peak"]
    assert sum(parts.values()) == data["fit"]["needed"]  # + allocator overhead and reserve
    assert int(page.find_all("line", **{"class": "capacity"})[0].attrs["data-capacity"]) == \
        data["fit"]["capacity"]
    table = {r.attrs["data-part"]: r for r in page.by_id("memory-table").find_all("tr")
             if "data-part" in r.attrs}
    assert size(mem["peak"]) in table["peak"].text and size(mem["activations"]) in \
        table["activations"].text
    assert page.by_id("fit").attrs["data-fits"] == "false"
    changes = page.by_id("changes").find_all("tr", **{"data-fits": "true"}) + \
        page.by_id("changes").find_all("tr", **{"data-fits": "false"})
    assert len(changes) == len(data["fit"]["changes"])

    # Communication: per kind and mesh dimension, and against the minimum.
    comm = {(r.attrs["data-source"], r.attrs["data-kind"], r.attrs["data-dim"]): int(r.attrs["data-count"])
            for r in page.by_id("comm").find_all("tr") if "data-kind" in r.attrs}
    assert comm == {(r["source"], r["kind"], r["mesh_dim"]): r["count"]
                    for r in data["comm_per_step"]["collectives"]}
    assert page.by_id("minimum").attrs["data-verdict"] == data["comm_minimum"]["verdict"]
    minimum = {(r.attrs["data-kind"], r.attrs["data-pass"]): int(r.attrs["data-minimum"])
               for r in page.by_id("minimum-table").find_all("tr") if "data-kind" in r.attrs}
    assert minimum == {(m["kind"], m["pass"]): m["count"] for m in data["comm_minimum"]["collectives"]}

    shot = tmp_path / "validate.png"
    screenshot(browser, page_file, shot)
    _keep(shot, "validate-page.png")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A real (tiny) training run: 2 processes, TP 2 with SP and loss parallel."""
    folder = tmp_path_factory.mktemp("run") / "run"
    sets = ["model.kwargs.n_layers=2", "train.steps=6", "train.seq_len=32",
            "train.global_batch_size=2", "data.max_bytes=100000", "checkpoint.enabled=false",
            f"metrics.run_dir={folder}", "metrics.log_interval=1"]
    tpplan_cli("train", "--plan", PLAN, "--nproc", "2", *[a for s in sets for a in ("--set", s)],
               check=True)
    return folder


def test_the_report_page_holds_the_runs_metrics_and_its_plan(browser, run_dir, tmp_path):
    page_file = tmp_path / "run.html"
    data = json.loads(tpplan_cli("report", run_dir, "--json", "--html", page_file,
                                 check=True).stdout)
    rows = data["run"]["metrics"]
    assert [r["step"] for r in rows] == list(range(1, 7)) and data["run"]["world_size"] == 2
    page = _clean(*rendered_dom(browser, page_file))
    charts = {c.attrs["data-series"]: c for c in page.find_all("svg", **{"class": "chart"})}
    assert {"loss", "tokens_per_s", "grad_norm"} <= set(charts)
    for key in ("loss", "tokens_per_s", "grad_norm"):
        assert int(charts[key].attrs["data-points"]) == len(rows)
        assert float(charts[key].attrs["data-last"]) == rows[-1][key]
        assert float(charts[key].attrs["data-first"]) == rows[0][key]
    assert "val_loss" not in charts  # this run did not evaluate
    assert "tp: 2" in page.by_id("plan-yaml").text
    # The plan it ran, dry-run at the run's world size: its mesh and memory.
    plan = page.by_id("plan")
    assert plan.by_id("mesh").attrs["data-world"] == "2"
    assert int(plan.find_all("tr", **{"data-part": "peak"})[0].find_all("td")[2].attrs["data-bytes"]) \
        == data["plan"]["memory_per_rank"]["peak"]
    shot = tmp_path / "report.png"
    screenshot(browser, page_file, shot)
    _keep(shot, "report-page.png")


def test_the_report_page_draws_validation_loss_when_the_run_logs_it(browser, run_dir, tmp_path):
    # A copy of the run whose rows carry a validation loss, as an evaluating run logs it.
    folder = tmp_path / "run"
    shutil.copytree(run_dir, folder)
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    rows = [dict(json.loads(line), val_loss=1.0 + i / 10) for i, line in enumerate(lines)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 7, "lo')
    page_file = tmp_path / "run.html"
    tpplan_cli("report", folder, "--html", page_file, check=True)
    page = _clean(*rendered_dom(browser, page_file))
    [chart] = page.find_all("svg", **{"data-series": "val_loss"})
    assert int(chart.attrs["data-points"]) == len(rows)
    assert float(chart.attrs["data-last"]) == rows[-1]["val_loss"]
    assert "could not be read" in page.by_id("main").text  # the cut-off last line, said so


def test_the_report_page_marks_faults_and_rejoins_on_the_curves(browser, run_dir, tmp_path):
    """A copy of the run laid out as a fault-tolerant one (docs/fault-tolerance.md): group 0
    down for steps 3-4 (its rows missing), group 1's rows saying the fault at 3 and the rejoin
    at 5. Each is a labelled vertical line on the loss and throughput curves, at its step."""
    folder = tmp_path / "run"
    shutil.copytree(run_dir, folder)
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    seen = {3: {"event": "fault", "replicas": 1}, 5: {"event": "rejoin", "replicas": 2}}
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if r["step"] not in (3, 4)))
    (folder / "replica-1").mkdir()
    (folder / "replica-1" / "metrics.jsonl").write_text(
        "".join(json.dumps({**r, **seen.get(r["step"], {})}) + "\n" for r in rows))
    page_file = tmp_path / "run.html"
    tpplan_cli("report", folder, "--html", page_file, check=True)
    page = _clean(*rendered_dom(browser, page_file))
    for key in ("loss", "tokens_per_s"):
        [chart] = page.find_all("svg", **{"data-series": key})
        assert int(chart.attrs["data-points"]) == len(rows), "the steps group 0 missed, from group 1"
        xs = [float(p.split(",")[0]) for p in chart.find_all("polyline")[0].attrs["points"].split()]
        marks = chart.find_all("g", **{"class": "event"})
        assert [(m.attrs["data-event"], int(m.attrs["data-step"])) for m in marks] == [("fault", 3), ("rejoin", 5)]
        for m in marks:  # on the curve's point of that step, drawn top to bottom, labelled
            [line] = m.find_all("line")
            assert float(line.attrs["x1"]) == float(line.attrs["x2"]) == xs[int(m.attrs["data-step"]) - 1]
            step = int(m.attrs["data-step"])
            assert m.find_all("text")[0].text == f"{m.attrs['data-event']} ({seen[step]['replicas']})"
    assert not page.find_all("svg", **{"data-series": "grad_norm"})[0].find_all("g", **{"class": "event"})


def test_report_on_a_folder_that_is_not_a_run_says_so(tmp_path):
    proc = tpplan_cli("report", tmp_path)
    assert proc.returncode == 1 and "no metrics.jsonl" in proc.stderr


def test_the_validate_page_shows_the_estimated_step_time(browser, tmp_path):
    """``validate --device h100``'s step-time estimate: every term and the total, as --json."""
    from tpplan.analysis import ANALYSES
    from tpplan.analysis.cost.step_time import estimate_step
    from tpplan.analysis.dryrun import dry_run
    from tpplan.commands.page import write_page
    from tpplan.plan.devices import DEVICES

    r = dry_run(PLAN, 4, ["train.seq_len=32", "train.global_batch_size=4"], ANALYSES)
    data = r.to_json()
    data["step_time"] = estimate_step(r, DEVICES["h100"]).to_json()
    page_file = tmp_path / "plan.html"
    write_page(str(page_file), "plan", data, "step time")
    page = _clean(*rendered_dom(browser, page_file))
    terms = {t.attrs["data-term"]: float(t.attrs["data-seconds"])
             for t in page.by_id("step-time-terms").find_all("tr") if "data-term" in t.attrs}
    assert terms == pytest.approx(data["step_time"]["terms"])
    assert float(page.by_id("step-time").attrs["data-step-time"]) == \
        pytest.approx(data["step_time"]["step_time"])


def test_the_search_page_ranks_the_layouts_of_the_json(browser, tmp_path):
    """``search --html``: the ranked table in ``--json``'s order and figures, and the counts."""
    page_file = tmp_path / "search.html"
    proc = tpplan_cli("search", "--plan", PLAN, "--world-size", "2", "--device", "h100",
                      "--set", "train.seq_len=32", "--set", "train.global_batch_size=4",
                      "--set", "model.kwargs.n_layers=2", "--top", "3", "--json", "--html",
                      page_file, check=True)
    data = json.loads(proc.stdout)
    page = _clean(*rendered_dom(browser, page_file))
    rows = [r for r in page.by_id("ranked").find_all("tr") if "data-rank" in r.attrs]
    assert [float(r.attrs["data-tokens"]) for r in rows] == \
        pytest.approx([r["tokens_per_s_per_device"] for r in data["ranked"]])
    assert [r.find_all("td")[-1].text for r in rows] == \
        [" ".join(f"--set '{s}'" for s in r["sets"]) for r in data["ranked"]]
    counts = page.by_id("search-counts").text
    left = data["not_ranked"]
    assert f"{data['candidates']} candidates: {data['passed_checks']} pass" in counts
    assert f"{left['comm_only']} bounded by their communication, {left['bound_only']} by " \
        "arithmetic alone" in counts
    dropped = [int(r.attrs["data-count"]) for r in page.by_id("dropped").find_all("tr")
               if "data-count" in r.attrs]
    assert dropped == [d["count"] for d in data["dropped"]]
