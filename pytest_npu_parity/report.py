"""The nightly parity report: one table of every compared leaf, its history across nights, and the
files people read in the morning.

A parity session produces one row per compared output leaf (the columns are ``COLUMNS``) and one
run-metadata dict (the keys are ``META_COLUMNS``). This module turns them into:

* ``results.parquet`` / ``results.csv`` — the rows, with the run metadata repeated as columns so each
  file stands alone (``precision_flags``, ``patch_set``, ``recipes`` are JSON text);
* ``meta.json`` — the run metadata as given;
* ``summary.md`` — a compact Markdown summary for a CI job summary;
* ``report.html`` — one self-contained page (see ``report_html``);
* a history file (parquet or csv) that gains one block of rows per run, from which "new failures since
  the last night", "failing since" and the trend plots are computed.

It also gives the JUnit XML properties for one test (``junit_properties``) and the command line
``python -m pytest_npu_parity report RESULTS_OR_HISTORY -o DIR`` (``main``).

JUnit properties under the default ``junit_family=xunit2`` (measured with pytest 9.2): pytest writes
every ``(name, value)`` of ``item.user_properties`` as ``<properties>`` inside that ``<testcase>``
whatever the family, and the pairs travel with the test report across pytest-xdist workers. Only the
``record_property`` *fixture* warns ("record_property is incompatible with junit_family 'xunit2'").
So the plugin appends ``junit_properties(rows)`` to ``item.user_properties`` directly (no warning,
works under xunit1/xunit2/legacy and xdist), and run-level metadata (``junit_suite_properties``) goes
to ``<testsuite><properties>`` through ``LogXML.add_global_property`` on the controller — the
``record_testsuite_property`` fixture does not work under xdist (pytest issue 7767).

This module never imports pytest; matplotlib (plots) and pyarrow (parquet) are the ``report`` extra
and are optional: without them the report is written without plots / without parquet, with a logged
warning.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import pandas as pd

log = logging.getLogger(__name__)

#: The row contract: one row per compared output leaf. Name -> one-line description.
COLUMNS: dict[str, str] = {
    "run_id": "identifier of the parity run (one pytest session) the row belongs to",
    "test_id": "pytest node id of the test that made the comparison",
    "check": "name of the check (parity.check's first argument)",
    "leaf": "path of the output leaf inside the check's output ('' for a bare tensor)",
    "submodule": "dotted name of the submodule under test ('' or missing for the whole model)",
    "suite": "parity suite of the test (e.g. 'aurora'); default: the folder under parity_suites/ or the test file",
    "recipe": "precision recipe the check ran under: fp32, bf16, bf16-weights, fp16",
    "dtype": "dtype of the target's output leaf (e.g. 'float32', 'bfloat16')",
    "shape": "shape of the target's output leaf as 'AxBxC' ('' for 0-d)",
    "numel": "number of elements of the leaf",
    "target": "device under test (npu:0, cuda:0, cpu)",
    "target_name": "human-readable target name (e.g. 'Ascend910B3')",
    "reference": "what the target was compared with: 'cpu' (live run) or 'baseline' ('recorded' when writing one)",
    "reference_provenance": "one line: where the reference came from (device, versions, date, file)",
    "max_abs": "max |actual - expected| in the tensor's units",
    "max_rel": "max |actual - expected| / (|expected| + 1e-10), ours (not msprobe's: see msprobe_max_rel_err)",
    "rel_l2": "||actual - expected||_2 / ||expected||_2",
    "cosine": "cosine similarity of actual and expected (1 = same direction; unrounded, 1 when both are all zero, 0 when one is)",
    "err_ratio": "max |a - e| / (atol + rtol*|e|) over elements; > 1 means out of tolerance",
    "mismatched": "number of elements outside atol + rtol*|expected| (plus NaN/Inf position mismatches)",
    "mismatched_frac": "mismatched / numel",
    "nonfinite_mismatched": "elements where NaN/Inf positions or kinds differ between the sides",
    "rtol": "relative tolerance in force",
    "atol": "absolute tolerance in force (tensor units)",
    "budget": "allowed fraction of mismatched elements",
    "tolerance_source": "where the tolerance came from: default, ini, marker or check",
    "tolerance_reason": "why a non-default tolerance is justified (empty for defaults)",
    "policy": "verdict policy the check was judged by: allclose (rtol/atol/budget), golden or distribution",
    "golden_policy": "the golden policy's ratio limits (+ [source: reason] when not the default); empty for allclose",
    "policy_note": "why a check that asked for the golden verdict was judged by allclose (no golden run possible)",
    "golden_dtype": "dtype of the golden run (float64 for fp32 work, float32 for bf16)",
    "golden_worst_metric": "golden policy: the metric (rmse, max_rel, mean_rel, small_share) nearest its limit",
    "golden_worst_margin": "golden policy: that metric's target/reference error ratio divided by its limit; > 1 fails",
    "msprobe_cosine": "msprobe 26.2.0 dump compare's Cosine (empty where msprobe writes no number, see msprobe_note)",
    "msprobe_euc_dist": "msprobe's EucDist: ||actual - expected||_2 after zeroing matched NaN/Inf",
    "msprobe_max_abs_err": "msprobe's MaxAbsErr (rounded to 12 decimals as msprobe does)",
    "msprobe_max_rel_err": "msprobe's MaxRelativeErr: max |(a - e) / e| in float32 (fp64: float64), eps added to both where e = 0",
    "msprobe_one_thousandth": "msprobe's One Thousandth Err Ratio: share of elements with msprobe relative error < 0.001",
    "msprobe_five_thousandths": "msprobe's Five Thousandths Err Ratio: share with msprobe relative error < 0.005",
    "msprobe_note": "msprobe's marker for cells without a number (unsupported, N/A, Nan) and why",
    "golden_msprobe_verdict": "golden msprobe policy: msprobe's own benchmark verdict (pass/error), without our NaN/Inf rule",
    "distribution_policy": "distribution verdict of a sampling check whose sides drew their own noise (alpha, permutations); empty otherwise",
    "dist_sample_dim": "distribution verdict: the sample axis of the leaf",
    "dist_groups": "distribution verdict: groups (conditioning inputs) compared, each with its own distribution",
    "dist_samples": "distribution verdict: target samples per group",
    "dist_expected_samples": "distribution verdict: reference samples per group",
    "dist_features": "distribution verdict: features (steps) per sample",
    "dist_pvalue": "distribution verdict: combined permutation p-value (maxT over the four statistics); <= dist_alpha fails",
    "dist_alpha": "distribution verdict: the false-failure rate the check allows",
    "dist_permutations": "distribution verdict: permutations of the test",
    "dist_mean_shift": "distribution verdict: largest |difference of per-step means| in pooled standard deviations",
    "dist_quantile_shift": "distribution verdict: largest |difference of per-step quantiles| in pooled standard deviations",
    "dist_spread_ratio": "distribution verdict: geometric mean over steps of std(target) / std(reference)",
    "dist_mean": "distribution statistic: mean squared difference of standardized per-step means",
    "dist_mean_pvalue": "its marginal permutation p-value",
    "dist_spread": "distribution statistic: |mean log ratio of per-step standard deviations|",
    "dist_spread_pvalue": "its marginal permutation p-value",
    "dist_quantiles": "distribution statistic: mean squared difference of the two empirical CDFs at the pooled quantiles",
    "dist_quantiles_pvalue": "its marginal permutation p-value",
    "dist_energy": "distribution statistic: energy distance of the standardized samples (Szekely & Rizzo), mean over groups",
    "dist_energy_pvalue": "its marginal permutation p-value",
    "problem": "structural failure (missing leaf, shape or dtype mismatch, exception); metrics NaN then",
    "verdict": "pass, fail (out of tolerance or structural problem), error (the check did not run) or recorded",
    "audit_mixed_device": "ops on the target that mixed devices (per check: repeated on each of its leaf rows)",
    "audit_h2d": "host-to-device copies during the target run (per check)",
    "audit_d2h": "device-to-host copies during the target run (per check)",
    "audit_host_sync": "host syncs (.item(), .cpu(), .numpy(), ...) during the target run (per check)",
    "audit_cpu_fallback": "ops that fell back to the CPU during the target run (per check)",
    "audit_fp64": "fp64 tensors created on the target (NPUs downcast fp64 to fp32) (per check)",
    "audit_budget": "the audit budget the check was judged by (--parity-audit, --parity-audit-mode fail|warn), e.g. 'h2d 0, host_sync any, …'",
    "audit_problem": "the audit events beyond the check's budget: op, devices, dtype and source line, one per line",
    "audit_verdict": "what the events beyond the audit budget did: fail (failed the check) or warn; empty within budget",
    "duration_s": "wall time of the check in seconds (reference + target + compare)",
}

#: Run metadata (one dict per run). In results and history tables these are columns repeated on every
#: row; ``run_id``, ``target``, ``target_name`` and ``reference`` are shared with ``COLUMNS``.
META_COLUMNS: dict[str, str] = {
    "run_id": "identifier of the run",
    "created": "UTC time the run started, ISO 8601",
    "git_revision": "revision of the code under test",
    "machine": "host name / machine description of the runner",
    "python": "Python version",
    "torch": "torch version",
    "torch_npu": "torch_npu version ('' when not installed)",
    "cann": "CANN toolkit version ('' off Ascend)",
    "transformers": "transformers version",
    "aurora_model": "aurora-model version",
    "plugin_version": "pytest-npu-parity version",
    "threads": "torch intra-op threads of the run (torch.get_num_threads(); bf16 CPU results depend on it)",
    "interop_threads": "torch inter-op threads of the run (torch.get_num_interop_threads())",
    "target": "device under test of the run",
    "target_name": "human-readable target name",
    "reference": "cpu (live) or baseline",
    "rng": "random streams of sampling checks: shared (one CPU stream) or device (each side its own; distribution verdicts)",
    "recipes": "recipes of the run (JSON list)",
    "precision_flags": "precision flags in force (JSON object: TF32/HF32 switches, matmul precision)",
    "patch_set": "names of the adaptation patches applied (JSON list)",
    "pytest_args": "the pytest command line arguments (JSON list, or one string)",
}

#: Columns every row must have.
REQUIRED = ("test_id", "check", "leaf", "verdict")
#: Allowed verdicts; ``fail`` and ``error`` count as failing. ``recorded``: a baseline was written
#: (``--update-baselines``), nothing was compared.
VERDICTS = ("pass", "fail", "error", "recorded")
FAILING = ("fail", "error")
#: A leaf is "the same comparison" across runs when these match (plus the target's device type).
HISTORY_KEY = ("test_id", "check", "leaf", "recipe")

_FLOAT = {"max_abs", "max_rel", "rel_l2", "cosine", "err_ratio", "mismatched_frac", "rtol", "atol", "budget", "duration_s",
          "dist_pvalue", "dist_alpha", "dist_mean_shift", "dist_quantile_shift", "dist_spread_ratio", "dist_mean",
          "dist_mean_pvalue", "dist_spread", "dist_spread_pvalue", "dist_quantiles", "dist_quantiles_pvalue",
          "dist_energy", "dist_energy_pvalue",
          "golden_worst_margin", "msprobe_cosine", "msprobe_euc_dist", "msprobe_max_abs_err", "msprobe_max_rel_err",
          "msprobe_one_thousandth", "msprobe_five_thousandths"}
_INT = {"numel", "mismatched", "nonfinite_mismatched", "dist_sample_dim", "dist_groups", "dist_samples",
        "dist_expected_samples", "dist_features", "dist_permutations", "audit_mixed_device", "audit_h2d", "audit_d2h",
        "audit_host_sync", "audit_cpu_fallback", "audit_fp64"}
_JSON_META = {"recipes", "precision_flags", "patch_set", "pytest_args"}
AUDIT_COLUMNS = tuple(c for c in COLUMNS if c.startswith("audit_") and c.removeprefix("audit_") in
                      ("mixed_device", "h2d", "d2h", "host_sync", "cpu_fallback", "fp64"))


# --------------------------------------------------------------------------------------------
# the table


def _all_columns() -> list[str]:
    return list(COLUMNS) + [c for c in META_COLUMNS if c not in COLUMNS]


def _meta_cell(key: str, value: Any) -> Any:
    if value is None:
        return None
    if key in _JSON_META or isinstance(value, (dict, list, tuple)):
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
    for col in _all_columns():
        if col not in df.columns:
            df[col] = None
    if meta:
        for key in META_COLUMNS:
            if key in meta and meta[key] is not None:
                cell = _meta_cell(key, meta[key])
                df[key] = df[key].astype(object).where(df[key].notna(), cell)

    for col in df.columns:
        if col in _FLOAT:
            df[col] = pd.to_numeric(df[col], errors="coerce").astype("float64")
        elif col in _INT:
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
    order = _all_columns()
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
        elif key in _JSON_META and isinstance(value, str):
            try:
                meta[key] = json.loads(value)
            except ValueError:
                meta[key] = value
        else:
            meta[key] = value
    return meta


# --------------------------------------------------------------------------------------------
# runs and history


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
            text_cols = {c: str for c in _all_columns() if c not in _FLOAT and c not in _INT}
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


# --------------------------------------------------------------------------------------------
# summary


def _severity(df: pd.DataFrame) -> pd.Series:
    """err_ratio, with failing rows without a ratio (structural problems) ranked first."""
    ratio = df["err_ratio"].astype("float64")
    failing = df["verdict"].isin(FAILING)
    return ratio.where(~(ratio.isna() & failing), math.inf).fillna(-1.0)


def _by_severity(df: pd.DataFrame) -> pd.DataFrame:
    return df.assign(_sev=_severity(df)).sort_values("_sev", ascending=False, kind="stable").drop(columns="_sev")


def check_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per check (test_id, check, recipe): its verdict and its worst leaf.

    Returns:
        Columns test_id, check, recipe, suite, submodule, target, reference, reference_provenance,
        verdict (``error`` > ``fail`` > ``recorded`` > ``pass`` over its leaves), leaves, failing_leaves, worst_leaf,
        err_ratio, max_abs, max_rel, rel_l2 (max over leaves), cosine (min over leaves), mismatched
        (sum), numel (sum), msprobe_cosine (min), msprobe_max_rel_err (max), msprobe_one_thousandth (min;
        msprobe's dump-compare numbers, NaN where msprobe writes none), tolerance (text of the worst
        leaf's), problem; worst first.
    """
    cols = ["test_id", "check", "recipe", "suite", "submodule", "target", "reference", "reference_provenance",
            "verdict", "leaves", "failing_leaves", "worst_leaf", "err_ratio", "max_abs", "max_rel", "rel_l2",
            "cosine", "mismatched", "numel", "msprobe_cosine", "msprobe_max_rel_err", "msprobe_one_thousandth",
            "tolerance", "tolerance_source", "tolerance_reason", "problem"]
    if df.empty:
        return pd.DataFrame(columns=cols)
    out = []
    ranked = _by_severity(df)
    for _, group in ranked.groupby(["test_id", "check", "recipe"], sort=False, dropna=False):
        worst = group.iloc[0]
        verdicts = set(group["verdict"])
        verdict = next((v for v in ("error", "fail", "recorded") if v in verdicts), "pass")
        out.append({
            "test_id": worst["test_id"], "check": worst["check"], "recipe": worst["recipe"],
            "suite": worst["suite"], "submodule": worst["submodule"], "target": worst["target"],
            "reference": worst["reference"], "reference_provenance": worst["reference_provenance"],
            "verdict": verdict,
            "leaves": len(group), "failing_leaves": int(group["verdict"].isin(FAILING).sum()),
            "worst_leaf": worst["leaf"], "err_ratio": worst["err_ratio"],
            "max_abs": group["max_abs"].max(), "max_rel": group["max_rel"].max(),
            "rel_l2": group["rel_l2"].max(), "cosine": group["cosine"].min(),
            "mismatched": int(group["mismatched"].fillna(0).sum()), "numel": int(group["numel"].fillna(0).sum()),
            "msprobe_cosine": group["msprobe_cosine"].min(), "msprobe_max_rel_err": group["msprobe_max_rel_err"].max(),
            "msprobe_one_thousandth": group["msprobe_one_thousandth"].min(),
            "tolerance": tolerance_text(worst), "tolerance_source": worst["tolerance_source"],
            "tolerance_reason": worst["tolerance_reason"],
            "problem": next((p for p in group["problem"] if not _isna(p)), None),
        })
    return pd.DataFrame(out, columns=cols)


def tolerance_text(row: Mapping[str, Any]) -> str:
    """``rtol=1e-05 atol=1e-05 budget=0`` (plus ``[source: reason]`` for overrides) from a row; the
    golden policy's description (``golden rmse<=2 …``) for a row judged by the golden policy, the
    distribution policy's (``distribution alpha=0.001 permutations=1999``) for a distribution verdict."""
    if row.get("policy") == "golden" and not _isna(row.get("golden_policy")):
        return str(row["golden_policy"])
    if row.get("policy") == "distribution" and not _isna(row.get("distribution_policy")):
        return str(row["distribution_policy"])
    parts = [f"{k}={_num(row.get(k))}" for k in ("rtol", "atol", "budget") if not _isna(row.get(k))]
    source = row.get("tolerance_source")
    text = " ".join(parts) or "–"
    if not _isna(source) and source != "default":
        reason = row.get("tolerance_reason")
        text += f" [{source}" + (f": {reason}]" if not _isna(reason) and reason else "]")
    return text


def _num(x: Any, digits: int = 3) -> str:
    if _isna(x):
        return "–"
    x = float(x)
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.{digits}g}"


@dataclass
class Summary:
    """Everything the Markdown summary and the HTML page show, computed once.

    Frames are pandas DataFrames; ``new``/``since`` are ``None`` when no history was given.
    """

    meta: dict[str, Any]
    run_id: str | None
    checks: pd.DataFrame
    counts: dict[str, int]
    by_suite_recipe: pd.DataFrame
    worst: pd.DataFrame
    new: pd.DataFrame | None
    since: pd.DataFrame | None
    previous_run_id: str | None
    previous_created: Any
    history_runs: int
    overrides: pd.DataFrame
    audit_totals: dict[str, int] = field(default_factory=dict)
    top: int = 10
    history: pd.DataFrame | None = None
    audit_problems: pd.DataFrame | None = None


def summarize(df: pd.DataFrame, meta: Mapping[str, Any], history: pd.DataFrame | None = None, *, top: int = 10) -> Summary:
    """Compute the report's summary of one run.

    Args:
        df: the run's rows (``to_frame`` output or raw rows).
        meta: the run metadata.
        history: earlier runs (with or without this run's rows); enables new failures and since-when.
        top: how many checks the "worst" table keeps.
    """
    df = to_frame(df, meta)
    meta = dict(meta or {})
    run_id = meta.get("run_id") or (df["run_id"].dropna().iloc[0] if df["run_id"].notna().any() else None)
    checks = check_table(df)
    counts = {v: int((checks["verdict"] == v).sum()) for v in VERDICTS}
    counts.update(checks=len(checks), leaves=len(df), tests=int(df["test_id"].nunique()),
                  failing_leaves=int(df["verdict"].isin(FAILING).sum()))

    grouped = []
    for (suite, recipe), group in checks.groupby(["suite", "recipe"], dropna=False, sort=True):
        grouped.append({
            "suite": "–" if _isna(suite) else suite, "recipe": "–" if _isna(recipe) else recipe,
            "checks": len(group), "pass": int((group["verdict"] == "pass").sum()),
            "fail": int((group["verdict"] == "fail").sum()), "error": int((group["verdict"] == "error").sum()),
            "recorded": int((group["verdict"] == "recorded").sum()),
            "worst_err_ratio": _severity(group).max() if len(group) else math.nan,
        })
    by_suite_recipe = pd.DataFrame(grouped, columns=["suite", "recipe", "checks", "pass", "fail", "error", "recorded",
                                                     "worst_err_ratio"])
    by_suite_recipe["worst_err_ratio"] = by_suite_recipe["worst_err_ratio"].where(by_suite_recipe["worst_err_ratio"] >= 0)

    new = since = None
    prev_id = prev_created = None
    n_runs = 0
    full = combine_history(history, df) if history is not None and run_id is not None else None
    if full is not None:
        n_runs = len(runs(full))
        new = new_failures(full, run_id)
        since = failing_since(full, run_id)
        prev_id = previous_run(full, run_id)
        if prev_id is not None:
            table = runs(full)
            prev_created = table.loc[table["run_id"] == prev_id, "created"].iloc[0]

    worst = checks.head(top).copy()
    if since is not None and not worst.empty:
        first = since.groupby(["test_id", "check", "recipe"])["since_created"].min()
        keys = zip(worst["test_id"], worst["check"], worst["recipe"].map(lambda v: "" if _isna(v) else v))
        worst["failing_since"] = [first.get(k, pd.NaT) for k in keys]
    overrides = df[df["tolerance_source"].notna() & (df["tolerance_source"] != "default")]
    overrides = overrides.drop_duplicates(["check", "recipe", "rtol", "atol", "budget", "tolerance_source", "tolerance_reason"])
    # Audit counts are per check (each of its leaf rows repeats them): one row per check is summed.
    per_check = df.drop_duplicates(["test_id", "check", "recipe"])
    audit = {c.removeprefix("audit_"): int(pd.to_numeric(per_check[c], errors="coerce").fillna(0).sum())
             for c in AUDIT_COLUMNS}
    problems = per_check[per_check["audit_problem"].map(lambda v: bool(_txt(v)))]
    return Summary(meta=meta, run_id=run_id, checks=checks, counts=counts, by_suite_recipe=by_suite_recipe,
                   worst=worst, new=new, since=since, previous_run_id=prev_id, previous_created=prev_created,
                   history_runs=n_runs, overrides=overrides.reset_index(drop=True), audit_totals=audit, top=top, history=full,
                   audit_problems=problems.reset_index(drop=True))


def combine_history(history: pd.DataFrame, df: pd.DataFrame) -> pd.DataFrame:
    """``history`` plus the run in ``df`` when the history does not hold that run yet (both normalized)."""
    history = _normalized(history)
    ids = set(df["run_id"].dropna())
    if ids and ids <= set(history["run_id"].dropna()):
        return history
    return _concat([history, _normalized(df)])


def _normalized(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` itself when it already has every column (made by ``to_frame``), else ``to_frame(df)``."""
    return df if set(_all_columns()) <= set(df.columns) else to_frame(df)


def _concat(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """Concatenate normalized tables, keeping the column order of ``to_frame``."""
    frames = [f for f in frames if len(f)] or frames[:1]
    out = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0].reset_index(drop=True)
    order = _all_columns()
    for col in order:
        if col not in out.columns:
            out[col] = None
    return out[order + [c for c in out.columns if c not in order]]


def _md_cell(value: Any) -> str:
    text = "–" if _isna(value) else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _md_table(header: list[str], rows: Iterable[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
    return lines


def _date(value: Any) -> str:
    if _isna(value):
        return "–"
    ts = pd.Timestamp(value)
    ts = ts.tz_localize("UTC") if ts.tzinfo is None else ts.tz_convert("UTC")
    return ts.strftime("%Y-%m-%d %H:%M UTC")


def run_line(meta: Mapping[str, Any], references: Iterable[str] = ()) -> str:
    """One line naming target, reference, revision, machine and versions of a run.

    ``references`` (the rows' ``reference`` values) replace the run's ``auto`` reference setting.
    """
    target = meta.get("target") or "?"
    used = sorted({str(r) for r in references if not _isna(r)})
    reference = "/".join(used) if used and meta.get("reference") in (None, "auto") else meta.get("reference")
    if meta.get("target_name"):
        target += f" ({meta['target_name']})"
    versions = ", ".join(f"{k} {meta[k]}" for k in ("torch", "torch_npu", "cann", "transformers", "aurora_model")
                         if meta.get(k))
    parts = [f"target {target} vs reference {reference or '?'}"]
    if meta.get("git_revision"):
        parts.append(f"revision {str(meta['git_revision'])[:12]}")
    if meta.get("machine"):
        parts.append(f"on {meta['machine']}")
    if versions:
        parts.append(versions)
    if meta.get("threads") not in (None, ""):
        interop = meta.get("interop_threads")
        parts.append(f"{meta['threads']} torch threads" + (f" ({interop} inter-op)" if interop not in (None, "") else ""))
    return "; ".join(parts)


def _short_test(test_id: Any) -> str:
    return str(test_id).rsplit("/", 1)[-1]


def summary_markdown(df: "pd.DataFrame | list[Mapping[str, Any]]", meta: Mapping[str, Any],
                     history: pd.DataFrame | None = None, *, top: int = 10) -> str:
    """A compact Markdown summary of one run, fit for ``$GITHUB_STEP_SUMMARY``.

    Sections: headline (checks passed/failed/errored, target vs reference, versions, precision flags,
    patch set), pass/fail counts per suite and recipe, new failures since the previous run (needs
    ``history``), the ``top`` worst checks by error/tolerance ratio (with "failing since" when a
    history is given), tolerance overrides with their reasons, and audit totals.

    Args:
        df: the run's rows.
        meta: the run metadata (``META_COLUMNS``).
        history: earlier runs (e.g. ``load_history(path)``), with or without this run.
        top: rows of the worst-checks table.

    Returns:
        Markdown text (GitHub-flavoured tables), ending in a newline.
    """
    s = summarize(df, meta, history, top=top)
    return _summary_markdown(s)


def _summary_markdown(s: Summary) -> str:
    c = s.counts
    status = "✅" if c["fail"] == c["error"] == 0 and c["checks"] else ("❌" if c["checks"] else "⚪")
    when = _date(s.meta.get("created"))
    recorded = f", {c['recorded']} baselines recorded" if c["recorded"] else ""
    lines = [f"## {status} NPU parity: {c['pass']} passed, {c['fail']} failed, {c['error']} errors{recorded} "
             f"of {c['checks']} checks ({c['leaves']} leaves)", ""]
    lines.append(f"Run `{s.run_id or '?'}` at {when}: {run_line(s.meta, s.checks['reference'])}.")
    flags = s.meta.get("precision_flags")
    if flags:
        lines.append("Precision flags: " + ", ".join(f"`{k}={v}`" for k, v in dict(flags).items()) + ".")
    patches = s.meta.get("patch_set")
    if patches is not None:
        lines.append("Patch set: " + (", ".join(f"`{p}`" for p in patches) if patches else "none") + ".")
    lines.append("")

    if not c["checks"]:
        lines += ["No parity checks ran.", ""]
        return "\n".join(lines)

    lines += ["### Checks per suite and recipe", ""]
    extra = ["recorded"] if c["recorded"] else []
    lines += _md_table(["suite", "recipe", "checks", "pass", "fail", "error"] + extra + ["worst err/tol"],
                       ([r["suite"], r["recipe"], r["checks"], r["pass"], r["fail"], r["error"]]
                        + [r[k] for k in extra] + [_num(r["worst_err_ratio"])]
                        for r in s.by_suite_recipe.to_dict("records")))
    lines.append("")

    lines.append("### New failures since the previous run")
    lines.append("")
    if s.new is None:
        lines.append("No history given (`--parity-history PATH`), so new failures cannot be told from old ones.")
    elif s.previous_run_id is None:
        lines.append(f"First run of this target in the history: all {len(s.new)} failing leaves are new.")
    else:
        lines.append(f"Compared with run `{s.previous_run_id}` at {_date(s.previous_created)}: "
                     f"{len(s.new)} new failing leaves.")
    if s.new is not None and len(s.new):
        lines.append("")
        shown = s.new.head(2 * s.top)
        lines += _md_table(["test", "check", "leaf", "recipe", "err/tol now", "before"],
                           ([_short_test(r.test_id), r.check, _txt(r.leaf) or "·", r.recipe, _num(r.err_ratio),
                             f"{r.previous_verdict} ({_num(r.previous_err_ratio)})" if r.previous_verdict == "pass"
                             else r.previous_verdict] for r in shown.itertuples()))
        if len(s.new) > len(shown):
            lines.append(f"\n… and {len(s.new) - len(shown)} more in report.html.")
    lines.append("")

    lines += [f"### Worst checks by error/tolerance ratio (top {min(len(s.worst), len(s.checks))} of {len(s.checks)})", ""]
    header = ["verdict", "test", "check", "recipe", "worst leaf", "err/tol", "max abs", "rel L2", "cosine",
              "mismatched", "tolerance", "reference"]
    has_since = "failing_since" in s.worst.columns
    if has_since:
        header.append("failing since")
    rows = []
    for r in s.worst.itertuples():
        row = [_verdict_mark(r.verdict), _short_test(r.test_id), r.check, r.recipe, _txt(r.worst_leaf) or "·",
               _num(r.err_ratio), _num(r.max_abs), _num(r.rel_l2), _num(r.cosine, 7),
               f"{r.mismatched}/{r.numel}", r.tolerance, _reference_text(r.reference, r.reference_provenance, 60)]
        if _txt(r.problem):
            row[5] = f"{row[5]} ({r.problem})"
        if has_since:
            row.append(_date(r.failing_since) if r.verdict != "pass" else "")
        rows.append(row)
    lines += _md_table(header, rows)
    lines.append("")

    if len(s.overrides):
        lines += ["### Tolerance overrides", ""]
        lines += _md_table(["check", "recipe", "tolerance", "reason"],
                           ([r["check"], r["recipe"], tolerance_text(r), r["tolerance_reason"]]
                            for _, r in s.overrides.iterrows()))
        lines.append("")
    problems = s.audit_problems if s.audit_problems is not None else pd.DataFrame()
    if any(s.audit_totals.values()) or len(problems):
        lines += ["### Device-propagation audit", ""]
        lines.append("Events on the target, each check counted once: "
                     + ", ".join(f"{k} {v}" for k, v in s.audit_totals.items()) + ".")
        if len(problems):
            lines += ["", f"{len(problems)} check{'s' * (len(problems) != 1)} with events beyond their audit budget:", ""]
            rows = []
            for r in problems.itertuples():
                for event in str(r.audit_problem).splitlines()[1:]:
                    if event.startswith("  "):
                        rows.append([{"fail": "❌ failed", "warn": "⚠️ warned"}.get(_txt(r.audit_verdict), "–"),
                                     _short_test(r.test_id), r.check, r.recipe, f"`{event.strip()}`"])
            lines += _md_table(["audit", "test", "check", "recipe", "event (op, devices, dtype, source line)"], rows)
        lines.append("")
    return "\n".join(lines)


def _verdict_mark(verdict: str) -> str:
    return {"pass": "✅ pass", "fail": "❌ fail", "error": "💥 error"}.get(verdict, verdict)


def _reference_text(reference: Any, provenance: Any, limit: int | None = None) -> str:
    text = "–" if _isna(reference) else str(reference)
    if not _isna(provenance) and provenance:
        prov = str(provenance)
        if limit and len(prov) > limit:
            prov = prov[: limit - 1] + "…"
        text += f": {prov}"
    return text


# --------------------------------------------------------------------------------------------
# JUnit properties


def junit_properties(rows_for_one_test: "list[Mapping[str, Any]] | pd.DataFrame") -> list[tuple[str, str]]:
    """Key metrics of one test for its JUnit ``<testcase><properties>``.

    For each check of the test (and recipe, when the test ran more than one) the properties are
    ``parity.<check>.verdict``, ``.err_ratio`` (worst leaf), ``.worst_leaf``, ``.max_abs``,
    ``.max_rel``, ``.rel_l2`` (max over leaves), ``.cosine`` (min over leaves), ``.mismatched`` and
    ``.numel`` (sums), ``.tolerance`` and ``.reference``. Numbers are written with 6 significant
    digits.

    Append the pairs to ``item.user_properties`` (not the ``record_property`` fixture, which warns
    under the default ``junit_family=xunit2``); pytest writes them inside the ``<testcase>`` under
    every family and carries them across xdist workers (see the module docstring).

    Returns:
        ``[(name, value), ...]`` with ``str`` values; ``[]`` for no rows.
    """
    if isinstance(rows_for_one_test, pd.DataFrame) and rows_for_one_test.empty:
        return []
    if not isinstance(rows_for_one_test, pd.DataFrame) and not rows_for_one_test:
        return []
    checks = check_table(to_frame(rows_for_one_test))
    several_recipes = checks.groupby("check")["recipe"].nunique(dropna=False).gt(1)
    props: list[tuple[str, str]] = []
    for r in checks.itertuples():
        name = f"parity.{r.check}"
        if several_recipes.get(r.check, False):
            name += f".{r.recipe}"
        props += [
            (f"{name}.verdict", r.verdict),
            (f"{name}.err_ratio", _num(r.err_ratio, 6)),
            (f"{name}.worst_leaf", _txt(r.worst_leaf)),
            (f"{name}.max_abs", _num(r.max_abs, 6)),
            (f"{name}.max_rel", _num(r.max_rel, 6)),
            (f"{name}.rel_l2", _num(r.rel_l2, 6)),
            (f"{name}.cosine", _num(r.cosine, 9)),
            (f"{name}.mismatched", str(r.mismatched)),
            (f"{name}.numel", str(r.numel)),
            (f"{name}.tolerance", r.tolerance),
            (f"{name}.reference", _reference_text(r.reference, r.reference_provenance)),
        ]
    return props


def junit_suite_properties(meta: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Run metadata for ``<testsuite><properties>`` (``LogXML.add_global_property`` on the controller).

    Returns:
        ``[("parity.run_id", ...), ("parity.target", ...), ...]`` for the non-empty ``META_COLUMNS``;
        dicts and lists as JSON text.
    """
    return [(f"parity.{k}", _meta_cell(k, meta[k])) for k in META_COLUMNS if meta.get(k) not in (None, "", [], {})]


# --------------------------------------------------------------------------------------------
# writing the report


def render_html(df: "pd.DataFrame | list[Mapping[str, Any]]", meta: Mapping[str, Any],
                history: pd.DataFrame | None = None) -> str:
    """The self-contained HTML report of one run (see ``report_html.render_html``)."""
    from .report_html import render_html as _render

    return _render(df, meta, history)


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
        written (``parquet`` absent when pyarrow is not installed; a warning is logged).

    Raises:
        ValueError / TypeError: the rows break the row contract (see ``to_frame``).
        OSError: the folder cannot be written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(meta or {})
    df = to_frame(rows, meta)
    paths: dict[str, Path] = {}
    if _have_pyarrow():
        paths["parquet"] = out / "results.parquet"
        _write_table(df, paths["parquet"])
    else:
        log.warning("pyarrow is not installed: results.parquet skipped (pip install pytest-npu-parity[report])")
    paths["csv"] = out / "results.csv"
    _write_table(df, paths["csv"])
    paths["meta"] = out / "meta.json"
    paths["meta"].write_text(json.dumps(meta, indent=2, sort_keys=True, default=str) + "\n", encoding="utf-8")
    summary = summarize(df, meta, history)
    paths["summary"] = out / "summary.md"
    paths["summary"].write_text(_summary_markdown(summary), encoding="utf-8")
    from .report_html import render_summary_html

    paths["html"] = out / "report.html"
    paths["html"].write_text(render_summary_html(summary, df, history), encoding="utf-8")
    return paths


# --------------------------------------------------------------------------------------------
# command line


def _load_source(source: Path) -> tuple[pd.DataFrame, dict[str, Any] | None]:
    meta = None
    if source.is_dir():
        for name in ("results.parquet", "results.csv"):
            if (source / name).exists() and (name.endswith(".csv") or _have_pyarrow()):
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
