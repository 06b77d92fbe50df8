"""``summary.md``: the compact Markdown summary of one run, fit for a CI job summary."""
from __future__ import annotations

from typing import Any, Iterable, Mapping

import pandas as pd

from .summary import Summary, _date, _num, _reference_text, _short_test, run_line, summarize, tolerance_text
from .table import _isna, _txt


def _md_cell(value: Any) -> str:
    text = "–" if _isna(value) else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _md_table(header: list[str], rows: Iterable[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
    return lines


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
    """The text of ``summary_markdown`` for an already computed ``Summary``."""
    lines = _headline(s)
    if not s.counts["checks"]:
        lines += ["No parity checks ran.", ""]
        return "\n".join(lines)
    for section in (_suite_section, _new_failures_section, _worst_section, _overrides_section, _audit_section):
        lines += section(s)
    return "\n".join(lines)


def _headline(s: Summary) -> list[str]:
    """Status line, run line, precision flags and patch set, then a blank line."""
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
    reference_patches = s.meta.get("reference_patch_set")
    if reference_patches:
        lines.append("Reference side also under: " + ", ".join(f"`{p}`" for p in reference_patches) + ".")
    lines.append("")
    return lines


def _suite_section(s: Summary) -> list[str]:
    c = s.counts
    lines = ["### Checks per suite and recipe", ""]
    extra = ["recorded"] if c["recorded"] else []
    lines += _md_table(["suite", "recipe", "checks", "pass", "fail", "error"] + extra + ["worst err/tol"],
                       ([r["suite"], r["recipe"], r["checks"], r["pass"], r["fail"], r["error"]]
                        + [r[k] for k in extra] + [_num(r["worst_err_ratio"])]
                        for r in s.by_suite_recipe.to_dict("records")))
    lines.append("")
    return lines


def _new_failures_section(s: Summary) -> list[str]:
    lines = ["### New failures since the previous run", ""]
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
    return lines


def _worst_section(s: Summary) -> list[str]:
    lines = [f"### Worst checks by error/tolerance ratio (top {min(len(s.worst), len(s.checks))} of {len(s.checks)})", ""]
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
    return lines


def _overrides_section(s: Summary) -> list[str]:
    if not len(s.overrides):
        return []
    lines = ["### Tolerance overrides", ""]
    lines += _md_table(["check", "recipe", "tolerance", "reason"],
                       ([r["check"], r["recipe"], tolerance_text(r), r["tolerance_reason"]]
                        for _, r in s.overrides.iterrows()))
    lines.append("")
    return lines


def _audit_section(s: Summary) -> list[str]:
    problems = s.audit_problems if s.audit_problems is not None else pd.DataFrame()
    if not (any(s.audit_totals.values()) or len(problems)):
        return []
    lines = ["### Device-propagation audit", ""]
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
    return lines


def _verdict_mark(verdict: str) -> str:
    return {"pass": "✅ pass", "fail": "❌ fail", "error": "💥 error"}.get(verdict, verdict)
