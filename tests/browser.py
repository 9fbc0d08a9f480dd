"""A headless Chromium for the page tests: found locally (``TPPLAN_BROWSER`` names one),
run with the flags a container needs, its DOM after the page's scripts read back."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome",
         "chrome-headless-shell")


def find_browser() -> str | None:
    named = os.environ.get("TPPLAN_BROWSER")
    if named:
        return shutil.which(named) or (named if Path(named).is_file() else None)
    return next((path for path in map(shutil.which, NAMES) if path), None)


def browser_or_skip() -> str:
    """The Chromium a page test renders in; the test is skipped without one, and fails
    instead under ``TPPLAN_REQUIRE_BROWSER=1`` (.ci/run), so CI never skips a page."""
    import pytest

    found = find_browser()
    if found is None:
        if os.environ.get("TPPLAN_REQUIRE_BROWSER") == "1":
            pytest.fail("TPPLAN_REQUIRE_BROWSER=1 but no Chromium was found (see .ci/run)")
        pytest.skip("no Chromium found (chromium, chromium-browser, google-chrome; or set "
                    "TPPLAN_BROWSER)")
    return found


def run_browser(binary: str, page: Path, *flags: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """Open ``page`` headless; ``--no-sandbox`` because tests may run as root in a container
    (Chromium's sandbox refuses root), and console messages go to stderr."""
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run(
            [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--hide-scrollbars", f"--user-data-dir={profile}",
             "--enable-logging=stderr", "--v=0", "--virtual-time-budget=10000", *flags,
             page.resolve().as_uri()],
            capture_output=True, text=True, timeout=timeout)


def rendered_dom(binary: str, page: Path) -> tuple[str, str]:
    """The DOM after the page's scripts ran, and the browser's console log (stderr)."""
    proc = run_browser(binary, page, "--dump-dom")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout, proc.stderr


def screenshot(binary: str, page: Path, out: Path, width: int = 1400, height: int = 2400) -> None:
    proc = run_browser(binary, page, f"--window-size={width},{height}", f"--screenshot={out}")
    assert proc.returncode == 0 and out.is_file() and out.stat().st_size > 10_000, proc.stderr[-2000:]


class Element:
    def __init__(self, tag: str, attrs: dict[str, str], parent: "Element | None"):
        self.tag, self.attrs, self.parent = tag, attrs, parent
        self.children: list[Element] = []
        self.parts: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def find_all(self, tag: str | None = None, **attrs: str) -> list["Element"]:
        out = []
        for child in self.children:
            if (tag is None or child.tag == tag) and all(
                    child.attrs.get(k.replace("_", "-")) == v for k, v in attrs.items()):
                out.append(child)
            out += child.find_all(tag, **attrs)
        return out

    def by_id(self, ident: str) -> "Element":
        found = self.find_all(id=ident)
        assert found, f"no element with id {ident!r}"
        return found[0]


VOID = {"br", "img", "meta", "link", "input", "hr", "line", "rect", "polyline", "path"}


class _Parser(HTMLParser):
    def __init__(self):
        super().__init__()
        self.root = self.node = Element("document", {}, None)

    def handle_starttag(self, tag, attrs):
        el = Element(tag, {k: v or "" for k, v in attrs}, self.node)
        self.node.children.append(el)
        if tag not in VOID:
            self.node = el

    def handle_startendtag(self, tag, attrs):
        self.node.children.append(Element(tag, {k: v or "" for k, v in attrs}, self.node))

    def handle_endtag(self, tag):
        node = self.node
        while node is not None and node.tag != tag:
            node = node.parent
        if node is not None and node.parent is not None:
            self.node = node.parent

    def handle_data(self, data):
        node = self.node
        while node is not None:  # text counts for every enclosing element
            node.parts.append(data)
            node = node.parent


def parse(dom: str) -> Element:
    p = _Parser()
    p.feed(dom)
    return p.root
