"""The report table: result rows normalized into one pandas DataFrame (the row contract of ``columns``).

``to_frame`` checks and types the rows; the helpers here (missing values, severity ranking,
concatenation in column order) are shared by the history, the summary and the views.
"""
from __future__ import annotations

import json
import math
from typing import Any, Mapping

import pandas as pd

from .columns import (COLUMNS, FAILING, FLOAT_COLUMNS, INT_COLUMNS, JSON_META, META_COLUMNS, REQUIRED, VERDICTS,
                      all_columns)


def _meta_cell(key: str, value: Any) -> Any:
    if value is None:
        return None
    if key in JSON_META or isinstance(value, (dict, list, tuple)):
        if isinstance(value, str):
            return value
        return json.dumps(value, sort_keys=isinstance(value, dict), default=str)
    return str(value)


def _shape_text(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return "x".join(str(int(v)) for v in value)
    return value


def to_frame(rows: "list[Mapping[str, Any]] | pd.DataFrame", meta: Mapping[str, Any] | None = None) -> pd.DataFrame:
    """Normalize result rows into the report table.

    Args:
        rows: one mapping per compared leaf (keys from ``COLUMNS``; unknown keys are kept as extra
            columns), or a DataFrame of them (e.g. read back from results.parquet or a history file).
        meta: the run metadata; its ``META_COLUMNS`` fill the matching columns where a row has none.

    Returns:
        A new DataFrame with every ``COLUMNS`` and ``META_COLUMNS`` column (missing optional ones are
        NA), in that order, then any extra columns. Float metric columns are float64, count columns
        nullable ``Int64``, text columns Python ``str`` or ``None``; ``shape`` tuples become ``'AxB'``.

    Raises:
        TypeError: ``rows`` is neither a list of mappings nor a DataFrame.
        ValueError: a required column (``REQUIRED``) is missing or empty, or a verdict is not one
            of ``VERDICTS``; the message names the column and the offending rows.
    """
    if isinstance(rows, pd.DataFrame):
        df = rows.copy()
    elif isinstance(rows, (list, tuple)):
        bad = [i for i, r in enumerate(rows) if not isinstance(r, Mapping)]
        if bad:
            raise TypeError(f"result row {bad[0]} is a {type(rows[bad[0]]).__name__}, expected a dict of COLUMNS")
        df = pd.DataFrame.from_records([dict(r) for r in rows])
    else:
        raise TypeError(f"rows must be a list of dicts or a pandas DataFrame, got {type(rows).__name__}")

    if len(df) or len(df.columns):
        missing = [c for c in REQUIRED if c not in df.columns]
        if missing:
            raise ValueError(
                f"result rows lack required column(s) {missing}; every row needs {list(REQUIRED)} "
                "(see pytest_npu_parity.report.COLUMNS)"
            )
    for col in all_columns():
        if col not in df.columns:
            df[col] = None
    if meta:
        for key in META_COLUMNS:
            if key in meta and meta[key] is not None:
                cell = _meta_cell(key, meta[key])
                df[key] = df[key].astype(object).where(df[key].notna(), cell)

    for col in df.columns:
        if col in FLOAT_COLUMNS:
            df[col] = pd.to_numeric(df[col], errors="coerce").astype("float64")
        elif col in INT_COLUMNS:
            values = pd.to_numeric(df[col], errors="coerce")
            df[col] = values.round().astype("Int64")
        elif col in COLUMNS or col in META_COLUMNS:
            df[col] = _text_column(df[col], col)
    df["leaf"] = df["leaf"].fillna("")  # a bare tensor's path is ''
    no_suite = df["suite"].isna() & df["test_id"].notna()
    if no_suite.any():
        df.loc[no_suite, "suite"] = df.loc[no_suite, "test_id"].map(suite_of)

    for col in ("test_id", "check"):
        empty = df.index[df[col].isna()]
        if len(empty):
            raise ValueError(f"result rows {list(empty[:5])} have no {col!r}; every row needs {list(REQUIRED)}")
    bad = ~df["verdict"].isin(VERDICTS)
    if bad.any():
        first = df.loc[bad].iloc[0]
        raise ValueError(
            f"verdict {first['verdict']!r} of {first['test_id']} / {first['check']} is not one of {VERDICTS}"
        )
    order = all_columns()
    return df[order + [c for c in df.columns if c not in order]].reset_index(drop=True)


def _text_column(series: pd.Series, col: str) -> pd.Series:
    """Object dtype, ``str`` or ``None``; tuples (shapes) as ``AxB``, dicts/lists as JSON (vectorized when all text)."""
    series = series.astype(object)
    present = series.notna()
    if present.any() and pd.api.types.infer_dtype(series[present], skipna=True) != "string":
        convert = (lambda v: _meta_cell(col, _shape_text(v))) if col == "shape" else (lambda v: _meta_cell(col, v))
        series = series.map(lambda v: v if isinstance(v, str) or _isna(v) else convert(v))
        present = series.notna()
    return series.where(present, None)


def suite_of(test_id: str) -> str:
    """The suite a test belongs to when its row names none.

    ``parity_suites/aurora/test_layers.py::test_x`` -> ``aurora``; otherwise the test file's stem
    (``tests/test_model.py::test_y`` -> ``test_model``).
    """
    path = str(test_id).split("::", 1)[0].replace("\\", "/")
    parts = path.split("/")
    if "parity_suites" in parts[:-1]:
        return parts[parts.index("parity_suites") + 1]
    return parts[-1].removesuffix(".py")


def _txt(value: Any, default: str = "") -> str:
    """``value`` as text, ``default`` when it is None/NaN (pandas may turn None into NaN)."""
    return default if _isna(value) else str(value)


def _isna(value: Any) -> bool:
    if value is None:
        return True
    try:
        return bool(pd.isna(value))
    except (TypeError, ValueError):  # lists and arrays are not NA
        return False


def _severity(df: pd.DataFrame) -> pd.Series:
    """err_ratio, with failing rows without a ratio (structural problems) ranked first."""
    ratio = df["err_ratio"].astype("float64")
    failing = df["verdict"].isin(FAILING)
    return ratio.where(~(ratio.isna() & failing), math.inf).fillna(-1.0)


def _by_severity(df: pd.DataFrame) -> pd.DataFrame:
    return df.assign(_sev=_severity(df)).sort_values("_sev", ascending=False, kind="stable").drop(columns="_sev")


def _normalized(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` itself when it already has every column (made by ``to_frame``), else ``to_frame(df)``."""
    return df if set(all_columns()) <= set(df.columns) else to_frame(df)


def _concat(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """Concatenate normalized tables, keeping the column order of ``to_frame``."""
    frames = [f for f in frames if len(f)] or frames[:1]
    out = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0].reset_index(drop=True)
    order = all_columns()
    for col in order:
        if col not in out.columns:
            out[col] = None
    return out[order + [c for c in out.columns if c not in order]]
