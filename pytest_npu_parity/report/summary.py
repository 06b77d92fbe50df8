"""The summary of one run, read from its rows: per-check table, counts, worst checks, new failures.

``summarize`` computes a ``Summary`` once; the Markdown summary (``markdown``), the HTML page
(``html``) and the JUnit properties (``junit``) read it (or ``check_table``) and format numbers,
dates and tolerances with the helpers here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import pandas as pd

from .columns import AUDIT_COLUMNS, FAILING, VERDICTS
from .history import combine_history, failing_since, new_failures, previous_run, runs
from .table import _by_severity, _isna, _severity, _txt, to_frame


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


def _reference_text(reference: Any, provenance: Any, limit: int | None = None) -> str:
    text = "–" if _isna(reference) else str(reference)
    if not _isna(provenance) and provenance:
        prov = str(provenance)
        if limit and len(prov) > limit:
            prov = prov[: limit - 1] + "…"
        text += f": {prov}"
    return text
