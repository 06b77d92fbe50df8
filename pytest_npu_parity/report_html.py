"""Old import path of the report's HTML page; the code lives in ``pytest_npu_parity.report.html``.

``from pytest_npu_parity.report_html import render_html`` (and every other name of that module,
private helpers included) keeps working.
"""
from __future__ import annotations

from typing import Any

from .report import html as _html
from .report.html import (  # noqa: F401  (re-exported)
    MAX_PLOT_CHECKS, MAX_TABLE_ROWS, MAX_TREND_LINES, RATIO_FLOOR, render_html, render_summary_html,
)


def __getattr__(name: str) -> Any:
    """Any other name of ``pytest_npu_parity.report.html`` (e.g. its private helpers)."""
    try:
        return getattr(_html, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
