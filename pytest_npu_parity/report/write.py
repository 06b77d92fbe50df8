"""Writing the report folder of one run: results.parquet/csv, meta.json, summary.md, report.html."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping

import pandas as pd

from . import history as _history
from .html import render_summary_html, trajectory_plots
from .markdown import _summary_markdown
from .summary import summarize
from .table import to_frame

log = logging.getLogger("pytest_npu_parity.report")  # the package's logger, as before the split


def write_report(rows: "list[Mapping[str, Any]] | pd.DataFrame", meta: Mapping[str, Any],
                 out_dir: str | os.PathLike, *, history: pd.DataFrame | None = None) -> dict[str, Path]:
    """Write the report files of one run into ``out_dir`` (created if missing).

    Args:
        rows: the run's result rows (``COLUMNS``; optional columns may be missing).
        meta: the run metadata (``META_COLUMNS``).
        out_dir: the report folder.
        history: earlier runs, with or without this run (``load_history``); enables new failures,
            failing-since and the trend plot.

    Returns:
        ``{"parquet": ..., "csv": ..., "meta": ..., "summary": ..., "html": ...}`` — the paths
        written (``parquet`` absent when pyarrow is not installed; a warning is logged), and
        ``trajectory0``, ``trajectory1`` … for the PNG of each training-trajectory check the page
        plots (``trajectory-<i>.png``, ``html.trajectory_plots``).

    Raises:
        ValueError / TypeError: the rows break the row contract (see ``to_frame``).
        OSError: the folder cannot be written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(meta or {})
    df = to_frame(rows, meta)
    paths: dict[str, Path] = {}
    if _history._have_pyarrow():
        paths["parquet"] = out / "results.parquet"
        _history._write_table(df, paths["parquet"])
    else:
        log.warning("pyarrow is not installed: results.parquet skipped (pip install pytest-npu-parity[report])")
    paths["csv"] = out / "results.csv"
    _history._write_table(df, paths["csv"])
    paths["meta"] = out / "meta.json"
    paths["meta"].write_text(json.dumps(meta, indent=2, sort_keys=True, default=str) + "\n", encoding="utf-8")
    summary = summarize(df, meta, history)
    paths["summary"] = out / "summary.md"
    paths["summary"].write_text(_summary_markdown(summary), encoding="utf-8")
    for i, (_, png) in enumerate(trajectory_plots(df)):  # the plots the page embeds, as files too
        paths[f"trajectory{i}"] = out / f"trajectory-{i}.png"
        paths[f"trajectory{i}"].write_bytes(png)
    paths["html"] = out / "report.html"
    paths["html"].write_text(render_summary_html(summary, df, history), encoding="utf-8")
    return paths
