"""mkdocs hook: the generated options page writes option syntax such as ``golden [rmse=2 …] [# reason]``
as plain text; Markdown (and mkdocs-autorefs) would read ``[a] [b]`` as a reference link. Escape square
brackets that do not open an inline link on the generated reference pages, so they render as written."""
from __future__ import annotations

import re

PAGES = ("reference/options.md", "reference/report-columns.md")
_BRACKETS = re.compile(r"(?<!\\)\[([^\]\n]*)\](?![(:])")


def on_page_markdown(markdown: str, page, **_: object) -> str:
    """Escape ``[…]`` outside code spans on ``PAGES``; other pages are returned unchanged."""
    if page.file.src_uri not in PAGES:
        return markdown
    parts = re.split(r"(`[^`\n]*`)", markdown)
    return "".join(p if p.startswith("`") else _BRACKETS.sub(r"\\[\1\\]", p) for p in parts)
