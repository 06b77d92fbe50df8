"""``python -m pytest_npu_parity report RESULTS_OR_HISTORY -o DIR``: re-render a report from files."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pandas as pd

from . import history as _history
from .history import combine_history, load_history, meta_from_frame, runs
from .write import write_report


def _load_source(source: Path) -> tuple[pd.DataFrame, dict[str, Any] | None]:
    meta = None
    if source.is_dir():
        for name in ("results.parquet", "results.csv"):
            if (source / name).exists() and (name.endswith(".csv") or _history._have_pyarrow()):
                meta_path = source / "meta.json"
                if meta_path.exists():
                    meta = json.loads(meta_path.read_text(encoding="utf-8"))
                source = source / name
                break
        else:
            raise FileNotFoundError(f"{source} holds no results.parquet or results.csv")
    elif not source.exists():
        raise FileNotFoundError(f"{source} does not exist: give a results/history .parquet or .csv, or a report folder")
    else:
        meta_path = source.with_name("meta.json")
        if meta_path.exists() and source.name.startswith("results."):
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
    return load_history(source), meta


def main(argv: list[str] | None = None) -> int:
    """``python -m pytest_npu_parity report RESULTS_OR_HISTORY -o DIR``: re-render a report.

    RESULTS_OR_HISTORY is a ``results.parquet``/``results.csv`` (one run), a history file (many
    runs: the latest, or ``--run``, is rendered against the others), or a report folder.

    Returns:
        0 on success, 2 on bad input (message on stderr).
    """
    parser = argparse.ArgumentParser(
        prog="python -m pytest_npu_parity report",
        description="Re-render a parity report (summary.md, report.html, results.*) from results or a history file.",
    )
    parser.add_argument("source", metavar="RESULTS_OR_HISTORY",
                        help="results.parquet/.csv, a history .parquet/.csv, or a report folder")
    parser.add_argument("-o", "--output", required=True, metavar="DIR", help="folder to write the report into")
    parser.add_argument("--history", metavar="PATH", help="history file for trends and new failures (when SOURCE is one run)")
    parser.add_argument("--run", metavar="RUN_ID", help="which run of a history to render (default: the latest)")
    args = parser.parse_args(argv)
    try:
        table, meta = _load_source(Path(args.source))
        if table.empty:
            raise ValueError(f"{args.source} holds no result rows")
        history = load_history(args.history) if args.history else None
        ids = runs(table)["run_id"].tolist()
        run_id = args.run or ids[-1]
        if run_id not in ids:
            raise ValueError(f"run {run_id!r} is not in {args.source} (runs: {', '.join(map(str, ids[-10:]))})")
        if len(ids) > 1:
            history = table if history is None else combine_history(history, table)
        rows = table[table["run_id"] == run_id]
        if meta is None or meta.get("run_id") not in (None, run_id):
            meta = meta_from_frame(table, run_id)
        paths = write_report(rows, meta, args.output, history=history)
    except (OSError, ValueError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for kind, path in paths.items():
        print(f"{kind:8}{path}")
    return 0
