"""Regenerate the screenshots in docs/: the validate page of the 405B worked example
(docs/dry-run.md) on an H100 and the report page of a short real training run.

    python scripts/page_screenshots.py            # writes docs/validate-page.png, docs/report-page.png

Needs a Chromium (see tests/browser.py) and ~2 minutes of 4 CPU processes for the run.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from browser import find_browser, screenshot  # noqa: E402

VALIDATE = ["validate", "--plan", "plans/llama.yaml", "--world-size", "4096",
            "--set", "model.config=405b", "--set", "mesh.tp=8", "--set", "train.seq_len=8192",
            "--set", "train.global_batch_size=512", "--device", "h100"]
RUN = "runs/report-example"  # under runs/, which git ignores
TRAIN = ["train", "--plan", "plans/llama.yaml", "--nproc", "4", "--set", "train.steps=60",
         "--set", "checkpoint.enabled=false", "--set", "metrics.log_interval=20"]


def tpplan(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "tpplan", *args], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL)


def main() -> int:
    browser = find_browser()
    if browser is None:
        print("no Chromium found (install chromium, or set TPPLAN_BROWSER)", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tpplan(*VALIDATE, "--html", str(tmp / "plan.html"))
        screenshot(browser, tmp / "plan.html", ROOT / "docs" / "validate-page.png", 1400, 2600)
        tpplan(*TRAIN, "--overwrite", "--set", f"metrics.run_dir={RUN}")
        tpplan("report", RUN, "--html", str(tmp / "run.html"))
        screenshot(browser, tmp / "run.html", ROOT / "docs" / "report-page.png", 1400, 1500)
    print("wrote docs/validate-page.png, docs/report-page.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
