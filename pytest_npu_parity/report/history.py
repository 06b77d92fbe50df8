"""Runs and the history file: which runs a table holds, what failed since when, and the files.

A history file (parquet or csv) gains one block of rows per run (``append_history``); from it come
"new failures since the last night" (``new_failures``), "failing since" (``failing_since``) and the
trend plots. Reading and writing results/history tables (``load_history``, ``_write_table``) lives
here too: pyarrow (parquet) is optional, the ``report`` extra.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping

import pandas as pd

from .columns import FAILING, FLOAT_COLUMNS, HISTORY_KEY, INT_COLUMNS, JSON_META, META_COLUMNS, all_columns
from .table import _by_severity, _concat, _isna, _normalized, to_frame


def meta_from_frame(df: pd.DataFrame, run_id: str | None = None) -> dict[str, Any]:
    """Recover a run's metadata dict from the metadata columns of a results or history table.

    Args:
        df: a table made by ``to_frame`` (or read back from results/history files).
        run_id: which run; ``None`` means the latest (``latest_run``).

    Returns:
        ``{key: value}`` for ``META_COLUMNS`` present on the run's first row; JSON columns
        (``recipes``, ``precision_flags``, ``patch_set``) are decoded; NA becomes ``None``.

    Raises:
        ValueError: the table is empty or has no rows of ``run_id``.
    """
    if run_id is None:
        run_id = latest_run(df)
    rows = df[df["run_id"] == run_id] if "run_id" in df.columns else df.iloc[0:0]
    if rows.empty:
        raise ValueError(f"no rows of run {run_id!r} in the table")
    first = rows.iloc[0]
    meta: dict[str, Any] = {}
    for key in META_COLUMNS:
        value = first.get(key)
        if _isna(value):
            meta[key] = None
        elif key in JSON_META and isinstance(value, str):
            try:
                meta[key] = json.loads(value)
            except ValueError:
                meta[key] = value
        else:
            meta[key] = value
    return meta


def runs(history: pd.DataFrame) -> pd.DataFrame:
    """The runs of a history, oldest first.

    Returns:
        One row per ``run_id`` with ``created`` (``pandas.Timestamp``, UTC; NaT when unknown),
        ``target`` (the device type of its rows, e.g. ``npu``), ``rows`` and ``failing`` (leaf counts).
        Runs are ordered by ``created``, then by first appearance in the file.
    """
    if history.empty:
        return pd.DataFrame(columns=["run_id", "created", "target", "rows", "failing"])
    h = pd.DataFrame({
        "run_id": history["run_id"].to_numpy(), "created": history["created"].to_numpy(),
        "target": history["target"].to_numpy(), "_failing": history["verdict"].isin(FAILING).to_numpy(),
        "_order": range(len(history)),
    })
    out = h.groupby("run_id", sort=False, dropna=False).agg(
        created=("created", "first"), target=("target", "first"), rows=("_order", "size"),
        failing=("_failing", "sum"), _order=("_order", "min"),
    ).reset_index()
    out["created"] = _utc(out["created"])
    out["target"] = _target_kind(out["target"])
    out = out.sort_values(["created", "_order"], na_position="first", kind="stable")
    return out.drop(columns="_order").reset_index(drop=True)


def _utc(values: pd.Series) -> pd.Series:
    return pd.to_datetime(values, utc=True, errors="coerce", format="ISO8601")


def _target_kind(values: pd.Series) -> pd.Series:
    """``npu:0`` -> ``npu``: runs on different cards of one kind are the same series."""
    return values.astype(object).fillna("").astype(str).str.partition(":")[0]


def latest_run(df: pd.DataFrame) -> str:
    """The ``run_id`` of the latest run in ``df`` (by ``created``, then file order).

    Raises:
        ValueError: ``df`` has no rows.
    """
    table = runs(df)
    if table.empty:
        raise ValueError("the table has no rows, so it has no run")
    return table["run_id"].iloc[-1]


def previous_run(history: pd.DataFrame, run_id: str) -> str | None:
    """The run before ``run_id`` on the same target device type (``npu``/``cuda``/``cpu``), or ``None``.

    A CPU job and an NPU job may share one history file; each is compared with its own last night.

    Raises:
        ValueError: ``run_id`` is not in the history.
    """
    table = runs(history)
    where = table.index[table["run_id"] == run_id]
    if not len(where):
        raise ValueError(f"run {run_id!r} is not in the history (runs: {list(table['run_id'][-5:])})")
    pos = where[0]
    earlier = table.iloc[:pos]
    earlier = earlier[earlier["target"] == table.at[pos, "target"]]
    return None if earlier.empty else earlier["run_id"].iloc[-1]


def _keyed(df: pd.DataFrame) -> pd.DataFrame:
    out = df.copy()
    for col in HISTORY_KEY:
        out[col] = out[col].astype(object).fillna("")
    return out


def new_failures(history: pd.DataFrame, run_id: str) -> pd.DataFrame:
    """Leaves failing in ``run_id`` that passed, or were absent, in the previous run.

    "Previous run" is ``previous_run`` (same target device type); a leaf is the same leaf when
    ``HISTORY_KEY`` (test_id, check, leaf, recipe) matches. The test id is part of the key because
    two tests may name their checks alike. On a first night every failure is new.

    Args:
        history: a table holding at least the rows of ``run_id`` (and of earlier runs).
        run_id: the run to look at.

    Returns:
        The failing rows of ``run_id`` (verdict ``fail`` or ``error``) that are new, with added
        columns ``previous_run_id`` (None on a first night), ``previous_verdict`` (``pass`` or
        ``absent``) and ``previous_err_ratio``; worst first (by ``err_ratio``, structural problems
        first).

    Raises:
        ValueError: ``run_id`` is not in the history.
    """
    prev_id = previous_run(history, run_id)
    now = _keyed(history[(history["run_id"] == run_id) & history["verdict"].isin(FAILING)])
    key = list(HISTORY_KEY)
    if prev_id is None:
        before = pd.DataFrame(columns=key + ["previous_verdict", "previous_err_ratio"])
    else:
        before = _keyed(history[history["run_id"] == prev_id])[key + ["verdict", "err_ratio"]]
        before = before.drop_duplicates(key, keep="last").rename(
            columns={"verdict": "previous_verdict", "err_ratio": "previous_err_ratio"})
    merged = now.merge(before, on=key, how="left")
    merged["previous_verdict"] = merged["previous_verdict"].astype(object).where(merged["previous_verdict"].notna(), "absent")
    merged["previous_err_ratio"] = pd.to_numeric(merged["previous_err_ratio"], errors="coerce").astype("float64")
    merged.insert(len(merged.columns) - 2, "previous_run_id", prev_id)
    out = merged[~merged["previous_verdict"].isin(FAILING)]
    return _by_severity(out).reset_index(drop=True)


def failing_since(history: pd.DataFrame, run_id: str) -> pd.DataFrame:
    """For every failing leaf of ``run_id``: since when it has failed without a break.

    Walks back over the runs of the same target device type; the streak ends at the first run where
    the leaf passed or was absent.

    Returns:
        One row per failing leaf with ``HISTORY_KEY`` columns, ``since_run_id``, ``since_created``
        (``pandas.Timestamp`` UTC or NaT) and ``runs_failing`` (>= 1, this run included).

    Raises:
        ValueError: ``run_id`` is not in the history.
    """
    table = runs(history)
    pos = table.index[table["run_id"] == run_id]
    if not len(pos):
        raise ValueError(f"run {run_id!r} is not in the history")
    pos = pos[0]
    kind = table.at[pos, "target"]
    chain = table.iloc[: pos + 1]
    chain = chain[chain["target"] == kind]
    keyed = _keyed(history[history["verdict"].isin(FAILING) & history["run_id"].isin(chain["run_id"])])
    failing_by_run: dict[str, set[tuple]] = {}
    for rid, rows in keyed.groupby("run_id", sort=False):
        failing_by_run[rid] = set(map(tuple, rows[list(HISTORY_KEY)].itertuples(index=False)))
    current = failing_by_run.get(run_id, set())
    ids = list(chain["run_id"])
    created = dict(zip(chain["run_id"], chain["created"]))
    out = []
    for key in sorted(current):
        since, count = run_id, 0
        for rid in reversed(ids):
            if key not in failing_by_run.get(rid, ()):
                break
            since, count = rid, count + 1
        out.append((*key, since, created.get(since, pd.NaT), count))
    return pd.DataFrame(out, columns=[*HISTORY_KEY, "since_run_id", "since_created", "runs_failing"])


def load_history(path: str | os.PathLike) -> pd.DataFrame:
    """Read a results or history table (``.parquet`` or ``.csv``).

    Returns:
        The table normalized by ``to_frame`` (empty, with all columns, when the file does not exist).

    Raises:
        ValueError: the extension is neither ``.parquet`` nor ``.csv``, or the file's columns break
            the row contract (the message names the file).
        ImportError: a ``.parquet`` file without pyarrow installed (install the ``report`` extra).
    """
    path = Path(path)
    fmt = _format_of(path)
    if not path.exists():
        return to_frame([])
    try:
        if fmt == "parquet":
            _require_pyarrow(path)
            df = pd.read_parquet(path)
        else:
            text_cols = {c: str for c in all_columns() if c not in FLOAT_COLUMNS and c not in INT_COLUMNS}
            df = pd.read_csv(path, dtype=text_cols, keep_default_na=False, na_values=[""])
        return to_frame(df)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path}: not a parity results/history table: {exc}") from exc


def _format_of(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix in (".parquet", ".pq"):
        return "parquet"
    if suffix == ".csv":
        return "csv"
    raise ValueError(f"{path}: unknown table format {suffix!r}; name the file *.parquet or *.csv")


def _have_pyarrow() -> bool:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return False
    return True


def _require_pyarrow(path: Path) -> None:
    if not _have_pyarrow():
        raise ImportError(
            f"{path}: reading/writing parquet needs pyarrow; install it with "
            "`pip install pytest-npu-parity[report]` or use a .csv file"
        )


def _atomic_write(path: Path, write) -> None:
    """Write through a temporary file in the same folder, then rename over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_table(df: pd.DataFrame, path: Path) -> None:
    if _format_of(path) == "parquet":
        _require_pyarrow(path)
        _atomic_write(path, lambda p: df.to_parquet(p, index=False, engine="pyarrow"))
    else:
        _atomic_write(path, lambda p: df.to_csv(p, index=False))


def append_history(rows: "list[Mapping[str, Any]] | pd.DataFrame", meta: Mapping[str, Any],
                   history_path: str | os.PathLike, *, keep_runs: int | None = None) -> pd.DataFrame:
    """Append one run to a history file and return the whole history.

    Args:
        rows: the run's result rows (see ``to_frame``).
        meta: the run metadata; ``run_id`` and ``created`` are required.
        history_path: ``*.parquet`` or ``*.csv``; created with its folder when missing. One row per
            (run, test_id, check, leaf) with the run metadata as columns.
        keep_runs: keep only the newest this many runs (``None``: keep all).

    Returns:
        The history after the append (normalized, oldest run first).

    Behaviour: rows of an earlier run with the same ``run_id`` are replaced (re-appending a run is
    idempotent). The file is replaced atomically (temporary file + rename), so an interrupted write
    never leaves a truncated history; concurrent writers are not merged (under pytest-xdist only the
    controller appends).

    Raises:
        ValueError: ``meta`` lacks ``run_id``/``created``, the extension is unknown, or the rows
            break the row contract.
        ImportError: a ``.parquet`` path without pyarrow.
    """
    path = Path(history_path)
    _format_of(path)
    for key in ("run_id", "created"):
        if not meta.get(key):
            raise ValueError(f"run metadata lacks {key!r}, needed to append to the history {path}")
    if keep_runs is not None and keep_runs < 1:
        raise ValueError(f"keep_runs must be >= 1, got {keep_runs}")
    run = to_frame(rows, meta)
    run["run_id"] = str(meta["run_id"])
    old = load_history(path)
    old = old[old["run_id"] != str(meta["run_id"])]
    history = _concat([old, run])
    order = runs(history)["run_id"].tolist()
    if keep_runs is not None and len(order) > keep_runs:
        history = history[history["run_id"].isin(order[-keep_runs:])]
    rank = {rid: i for i, rid in enumerate(order)}
    history = history.sort_values("run_id", key=lambda s: s.map(rank), kind="stable").reset_index(drop=True)
    _write_table(history, path)
    return history


def combine_history(history: pd.DataFrame, df: pd.DataFrame) -> pd.DataFrame:
    """``history`` plus the run in ``df`` when the history does not hold that run yet (both normalized)."""
    history = _normalized(history)
    ids = set(df["run_id"].dropna())
    if ids and ids <= set(history["run_id"].dropna()):
        return history
    return _concat([history, _normalized(df)])
