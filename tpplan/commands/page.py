"""One self-contained HTML page from a command's JSON: the data inlined, drawn by inlined
JavaScript (``page/page.js``, ``page/page.css``). No network at view time, no library: the
page is the same object ``--json`` prints, so the two cannot disagree."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

__all__ = ["render_page", "write_page"]

ASSETS = Path(__file__).parent / "page"

TEMPLATE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>
{css}
</style>
</head>
<body data-kind="{kind}">
<h1>{title}</h1>
<p class="sub">{subtitle}</p>
<pre id="js-errors" hidden></pre>
<main id="main"></main>
<script type="application/json" id="data">{data}</script>
<script>
{js}
</script>
</body>
</html>
"""


def render_page(kind: str, data: dict[str, Any], title: str, subtitle: str = "") -> str:
    """The page for ``data``: ``kind`` is ``plan`` (``validate --json``), ``search``, ``run``
    (``report --json`` of one run) or ``runs`` (of several)."""
    # Inside <script>, "</" would end the element: JSON allows "<\\/" for "</".
    payload = json.dumps(data).replace("</", "<\\/")
    return TEMPLATE.format(title=html.escape(title), subtitle=html.escape(subtitle), kind=kind,
                           css=(ASSETS / "page.css").read_text(), data=payload,
                           js=(ASSETS / "page.js").read_text())


def write_page(path: str, kind: str, data: dict[str, Any], title: str, subtitle: str = "") -> None:
    Path(path).write_text(render_page(kind, data, title, subtitle))
