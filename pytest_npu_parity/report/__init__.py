"""The nightly parity report: one table of every compared leaf, its history across nights, and the
files people read in the morning.

A parity session produces one row per compared output leaf (the columns are ``COLUMNS``) and one
run-metadata dict (the keys are ``META_COLUMNS``). This package turns them into:

* ``results.parquet`` / ``results.csv`` — the rows, with the run metadata repeated as columns so each
  file stands alone (``precision_flags``, ``patch_set``, ``recipes`` are JSON text);
* ``meta.json`` — the run metadata as given;
* ``summary.md`` — a compact Markdown summary for a CI job summary;
* ``report.html`` — one self-contained page;
* a history file (parquet or csv) that gains one block of rows per run, from which "new failures since
  the last night", "failing since" and the trend plots are computed.

It also gives the JUnit XML properties for one test (``junit_properties``) and the command line
``python -m pytest_npu_parity report RESULTS_OR_HISTORY -o DIR`` (``main``).

The modules, each reading rows (never the runner or the plugin), in import order:

* ``columns`` — the one place a report column is named: the ordered column tables with a
  description per column, the name constants, verdicts; generates ``docs/reference/report-columns.md``;
* ``table`` — ``to_frame``: rows normalized into the typed report table;
* ``history`` — runs, new failures, failing-since; reading and writing results/history files;
* ``summary`` — ``summarize`` / ``Summary`` and ``check_table``, the per-run aggregation;
* ``markdown``, ``html``, ``junit`` — the views of a ``Summary`` (or of the rows);
* ``write`` — ``write_report``, the report folder; ``cli`` — the ``report`` command.

Every name this package had as one module (``pytest_npu_parity.report.to_frame``, ...) is still
importable from it. Names are loaded lazily: ``import pytest_npu_parity.report.columns`` does not
import pandas, so the check pipeline can name columns without the report stack.

This package never imports pytest; matplotlib (plots) and pyarrow (parquet) are the ``report`` extra
and are optional: without them the report is written without plots / without parquet, with a logged
warning.
"""
from __future__ import annotations

import importlib
from typing import Any

#: Exported name -> (module of this package, name there).
_EXPORTS: dict[str, tuple[str, str]] = {
    **{name: ("columns", name) for name in (
        "COLUMNS", "META_COLUMNS", "EXTRA_COLUMNS", "REQUIRED", "VERDICTS", "FAILING", "HISTORY_KEY",
        "AUDIT_COLUMNS", "Column", "all_columns", "reference_markdown")},
    "_FLOAT": ("columns", "FLOAT_COLUMNS"),
    "_INT": ("columns", "INT_COLUMNS"),
    "_JSON_META": ("columns", "JSON_META"),
    "_all_columns": ("columns", "all_columns"),
    **{name: ("table", name) for name in (
        "to_frame", "suite_of", "_meta_cell", "_shape_text", "_text_column", "_txt", "_isna", "_severity",
        "_by_severity", "_normalized", "_concat")},
    **{name: ("history", name) for name in (
        "meta_from_frame", "runs", "latest_run", "previous_run", "new_failures", "failing_since", "load_history",
        "append_history", "combine_history", "_utc", "_target_kind", "_keyed", "_format_of", "_have_pyarrow",
        "_require_pyarrow", "_atomic_write", "_write_table")},
    **{name: ("summary", name) for name in (
        "Summary", "summarize", "check_table", "tolerance_text", "run_line", "_num", "_date", "_short_test",
        "_reference_text")},
    **{name: ("markdown", name) for name in ("summary_markdown", "_summary_markdown", "_md_cell", "_md_table",
                                              "_verdict_mark")},
    **{name: ("junit", name) for name in ("junit_properties", "junit_suite_properties")},
    "render_html": ("html", "render_html"),
    "write_report": ("write", "write_report"),
    "log": ("write", "log"),
    **{name: ("cli", name) for name in ("main", "_load_source")},
}

__all__ = sorted(name for name in _EXPORTS if not name.startswith("_") and name != "log")


def __getattr__(name: str) -> Any:
    """Load an exported name from its module on first use (see ``_EXPORTS``)."""
    if name in _EXPORTS:
        module, attr = _EXPORTS[name]
        value = getattr(importlib.import_module(f"{__name__}.{module}"), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
