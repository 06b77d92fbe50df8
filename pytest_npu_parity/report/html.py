"""The HTML page of the parity report: one self-contained file, no network.

Everything is inline: CSS, a few lines of JavaScript (sortable tables and a filter box), and the plots
as base64 PNG data URIs drawn with matplotlib's Agg canvas (no pyplot state, so it is safe inside a
pytest session). Plots:

* error/tolerance per check — every leaf's ``err_ratio`` on a log axis, the tolerance at 1;
* submodule × recipe heatmap — the worst ``err_ratio`` per cell (log colour scale centred on 1);
* trend lines per check across runs — the worst ``err_ratio`` per check and run, from the history;
* one figure per training-trajectory check (``ParityCase.trajectory``; ``trajectory_plots``, also
  written as PNG files by ``write.write_report``): the loss and grad-norm curves of both sides, and
  their relative difference per step against the check's limit.

Without matplotlib the page keeps its tables and says how to get the plots (the ``report`` extra).
"""
from __future__ import annotations

import base64
import html
import io
import json
import logging
import math
from typing import Any, Mapping

import pandas as pd

from .columns import AUDIT_COLUMNS, FAILING, TRAJECTORY_SERIES
from .history import runs
from .summary import Summary, _date, _num, _reference_text, _short_test, run_line, summarize, tolerance_text
from .table import _isna, _severity, _txt, to_frame

log = logging.getLogger("pytest_npu_parity.report_html")  # the module's logger name before the split

#: Checks shown in the error/tolerance plot and lines in the trend plot (the worst ones).
MAX_PLOT_CHECKS = 40
MAX_TREND_LINES = 10
#: Lower clip of the heatmap's colour scale, and where zeros sit when nothing else is known.
RATIO_FLOOR = 1e-4
#: Trajectory checks plotted (the first ones, failing first).
MAX_TRAJECTORY_PLOTS = 12
#: Rows of the "all compared leaves" table (the worst first); the rest are in results.parquet/csv.
MAX_TABLE_ROWS = 2000

_COLORS = {"pass": "#2e7d32", "fail": "#c62828", "error": "#6a1b9a"}


def render_html(df: "pd.DataFrame | list[Mapping[str, Any]]", meta: Mapping[str, Any],
                history: pd.DataFrame | None = None) -> str:
    """The report page of one run as one HTML string.

    Args:
        df: the run's rows (``columns.COLUMNS``).
        meta: the run metadata (``columns.META_COLUMNS``).
        history: earlier runs (with or without this run) for new failures and trend lines.

    Returns:
        A complete HTML document with no external URL: inline CSS/JS, plots as data URIs.
    """
    frame = to_frame(df, meta)
    return render_summary_html(summarize(frame, meta, history), frame, history)


def render_summary_html(s: Summary, df: pd.DataFrame, history: pd.DataFrame | None) -> str:
    """``render_html`` for an already computed ``Summary`` (so ``write_report`` computes it once)."""
    plots = _plots(s, df, history)
    c = s.counts
    title = f"NPU parity report — {s.run_id or 'run'}"
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_e(title)}</title>", f"<style>{_CSS}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
        f'<p class="runline">{_e(run_line(s.meta, s.checks["reference"]))}. Started {_e(_date(s.meta.get("created")))}.'
        + _provenance_line(df) + "</p>",
        '<div class="cards">',
        _card("checks", c["checks"], ""), _card("passed", c["pass"], "pass"),
        _card("failed", c["fail"], "fail" if c["fail"] else ""), _card("errors", c["error"], "error" if c["error"] else ""),
        *([_card("recorded", c["recorded"], "")] if c["recorded"] else []),
        _card("new failures", "–" if s.new is None else len(s.new), "fail" if s.new is not None and len(s.new) else ""),
        _card("leaves", c["leaves"], ""),
        "</div>",
        _meta_details(s.meta),
        "<h2>Checks per suite and recipe</h2>",
        _suite_table(s),
        "<h2>New failures since the previous run</h2>", _new_failures_html(s),
        f"<h2>Worst checks by error/tolerance ratio (top {len(s.worst)} of {len(s.checks)})</h2>", _worst_html(s),
        "<h2>Plots</h2>",
    ]
    parts.append('<div class="row">')
    for k, (plot_title, uri, note) in enumerate(plots):
        if k == 2:
            parts.append('</div><div class="row">')
        parts.append(f'<figure><figcaption>{_e(plot_title)}</figcaption>')
        if uri:
            parts.append(f'<img class="plot" alt="{_e(plot_title)}" src="{uri}">')
        if note:
            parts.append(f'<p class="note">{_e(note)}</p>')
        parts.append("</figure>")
    parts.append("</div>")
    trajectories = trajectory_plots(df)
    if trajectories:
        parts += ["<h2>Training trajectories</h2>",
                  '<p class="note">Top: loss and global gradient norm per step, target and reference. Bottom: '
                  "relative difference per step (log scale), its 10-step trailing mean (the curves part where "
                  "it crosses the limit) and the check's limit on the mean.</p>",
                  '<div class="row">']
        for title, png in trajectories:
            uri = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
            parts.append(f'<figure><figcaption>{_e(title)}</figcaption>'
                         f'<img class="plot" alt="{_e(title)}" src="{uri}"></figure>')
        parts.append("</div>")
    if len(s.overrides):
        parts += ["<h2>Tolerance overrides</h2>",
                  _table(["check", "recipe", "tolerance", "reason"],
                         [[(r["check"],), (r["recipe"],), (tolerance_text(r),), (r["tolerance_reason"],)]
                          for _, r in s.overrides.iterrows()])]
    shown = (f"the {MAX_TABLE_ROWS} worst of {len(df)}; all are in results.parquet / results.csv"
             if len(df) > MAX_TABLE_ROWS else str(len(df)))
    parts += [f"<h2>All compared leaves ({_e(shown)})</h2>",
              '<p><input id="filter" type="search" placeholder="filter rows (any text, e.g. fail, bf16, dec_layers)" '
              'size="60"> <span id="shown"></span></p>',
              _results_html(df), f"<script>{_JS}</script></body></html>"]
    return "\n".join(parts) + "\n"


# --------------------------------------------------------------------------------------------
# html pieces


def _e(value: Any) -> str:
    return html.escape("–" if _isna(value) else str(value), quote=True)


def _n(x: Any, digits: int = 3) -> tuple[str, str]:
    """A numeric cell: (shown text, sort value)."""
    if _isna(x):
        return "–", ""
    v = float(x)
    sort = "Infinity" if v == math.inf else "-Infinity" if v == -math.inf else repr(v)
    return (_num(v, digits) if not float(v).is_integer() or abs(v) >= 1e6 else str(int(v))), sort


def _table(header: list[str], rows: list[list[tuple]], *, sortable: bool = False, row_classes: list[str] | None = None,
           table_id: str | None = None, numeric: set[int] | None = None) -> str:
    """Rows of cells; a cell is ``(text,)``, ``(text, sort_value)`` for numbers, or ``(text, sort, title)``."""
    numeric = numeric if numeric is not None else {i for i, cell in enumerate(rows[0]) if len(cell) > 1} if rows else set()
    attrs = ' class="sortable"' if sortable else ""
    attrs += f' id="{table_id}"' if table_id else ""
    out = [f'<div class="scroll"><table{attrs}><thead><tr>']
    num_attr = ' data-type="num"'
    out += [f"<th{num_attr if i in numeric else ''}>{_e(h)}</th>" for i, h in enumerate(header)]
    out.append("</tr></thead><tbody>")
    for k, row in enumerate(rows):
        cls = f' class="{row_classes[k]}"' if row_classes else ""
        cells = []
        for cell in row:
            text = _e(cell[0])
            extra = ""
            if len(cell) > 1 and cell[1] != "":
                extra += f' data-v="{_e(cell[1])}"'
            if len(cell) > 2 and cell[2]:
                extra += f' title="{_e(cell[2])}"'
            cells.append(f"<td{extra}>{text}</td>")
        out.append(f"<tr{cls}>" + "".join(cells) + "</tr>")
    out.append("</tbody></table></div>")
    return "".join(out)


def _provenance_line(df: pd.DataFrame) -> str:
    pairs = df[["reference", "reference_provenance"]].dropna().drop_duplicates()
    if len(pairs) == 1:
        return f"<br>Reference provenance: {_e(_reference_text(*pairs.iloc[0]))}."
    if len(pairs) > 1:
        return f"<br>{len(pairs)} reference provenances (hover a reference cell to see it)."
    return ""


def _card(label: str, value: Any, kind: str) -> str:
    return f'<div class="card {kind}"><div class="value">{_e(value)}</div><div class="label">{_e(label)}</div></div>'


def _meta_details(meta: Mapping[str, Any]) -> str:
    rows = []
    for key, value in meta.items():
        if isinstance(value, (dict, list)):
            value = json.dumps(value, sort_keys=isinstance(value, dict))
        rows.append([(key,), (value,)])
    return "<details><summary>Run metadata (versions, precision flags, patch set)</summary>" + _table(["key", "value"], rows) + "</details>"


def _suite_table(s: Summary) -> str:
    extra = ["recorded"] if s.counts["recorded"] else []
    rows = [[(r["suite"],), (r["recipe"],), _n(r["checks"]), _n(r["pass"]), _n(r["fail"]), _n(r["error"])]
            + [_n(r[k]) for k in extra] + [_n(r["worst_err_ratio"])] for r in s.by_suite_recipe.to_dict("records")]
    return _table(["suite", "recipe", "checks", "pass", "fail", "error"] + extra + ["worst err/tol"], rows, sortable=True)


def _new_failures_html(s: Summary) -> str:
    if s.new is None:
        return '<p class="note">No history given (--parity-history PATH), so new failures cannot be told from old ones.</p>'
    if s.previous_run_id is None:
        head = f"<p>First run of this target in the history: all {len(s.new)} failing leaves are new.</p>"
    else:
        head = f"<p>Compared with run <code>{_e(s.previous_run_id)}</code> at {_e(_date(s.previous_created))}: {len(s.new)} new failing leaves.</p>"
    if s.new.empty:
        return head
    rows = [[(_short_test(r.test_id), "", r.test_id), (r.check,), (_txt(r.leaf) or "·",), (r.recipe,), _n(r.err_ratio),
             (r.previous_verdict,), _n(r.previous_err_ratio), (r.problem,)] for r in s.new.itertuples()]
    return head + _table(["test", "check", "leaf", "recipe", "err/tol now", "before", "err/tol before", "problem"],
                         rows, sortable=True, numeric={4, 6})


def _worst_html(s: Summary) -> str:
    if s.worst.empty:
        return "<p>No parity checks ran.</p>"
    has_since = "failing_since" in s.worst.columns
    header = ["verdict", "test", "check", "recipe", "worst leaf", "err/tol", "max abs", "max rel", "rel L2", "cosine",
              "mismatched", "tolerance", "reference"] + (["failing since"] if has_since else [])
    rows, classes = [], []
    for r in s.worst.itertuples():
        row = [(r.verdict,), (_short_test(r.test_id), "", r.test_id), (r.check,), (r.recipe,),
               (_txt(r.worst_leaf) or "·", "", _txt(r.problem)), _n(r.err_ratio), _n(r.max_abs), _n(r.max_rel), _n(r.rel_l2),
               _n(r.cosine, 7), (f"{r.mismatched}/{r.numel}", r.mismatched), (r.tolerance,),
               (r.reference, "", _reference_text(r.reference, r.reference_provenance))]
        if has_since:
            row.append((_date(r.failing_since) if r.verdict != "pass" else "",))
        rows.append(row)
        classes.append(r.verdict)
    return _table(header, rows, sortable=True, row_classes=classes, numeric={5, 6, 7, 8, 9, 10})


_RESULT_COLUMNS = ["verdict", "test_id", "check", "leaf", "submodule", "recipe", "dtype", "shape", "err_ratio", "max_abs",
                   "max_rel", "rel_l2", "cosine", "mismatched", "numel", "tolerance", "reference", "audit", "duration_s"]


def _results_html(df: pd.DataFrame) -> str:
    if df.empty:
        return "<p>No rows.</p>"
    ordered = df.assign(_sev=_severity(df)).sort_values("_sev", ascending=False, kind="stable").head(MAX_TABLE_ROWS)
    rows, classes = [], []
    for r in ordered.to_dict("records"):
        audit = {k.removeprefix("audit_"): r[k] for k in AUDIT_COLUMNS if not _isna(r[k]) and r[k]}
        rows.append([
            (r["verdict"],), (r["test_id"],), (r["check"],), (_txt(r["leaf"]) or "·", "", _txt(r["problem"])),
            (r["submodule"],), (r["recipe"],), (r["dtype"],), (r["shape"],), _n(r["err_ratio"]), _n(r["max_abs"]),
            _n(r["max_rel"]), _n(r["rel_l2"]), _n(r["cosine"], 7), _n(r["mismatched"]), _n(r["numel"]),
            (tolerance_text(r),), (r["reference"], "", _reference_text(r["reference"], r["reference_provenance"])),
            ((", ".join(f"{k} {v}" for k, v in audit.items()) or "–") + (" ⚠" if _txt(r.get("audit_problem")) else ""),
             sum(int(v) for v in audit.values()), _txt(r.get("audit_problem"))),
            _n(r["duration_s"]),
        ])
        classes.append(r["verdict"])
    return _table(_RESULT_COLUMNS, rows, sortable=True, row_classes=classes, table_id="results",
                  numeric={8, 9, 10, 11, 12, 13, 14, 17, 18})


# --------------------------------------------------------------------------------------------
# plots


def _plots(s: Summary, df: pd.DataFrame, history: pd.DataFrame | None) -> list[tuple[str, str | None, str | None]]:
    titles = ["Error / tolerance per check (log scale; > 1 is out of tolerance)",
              "Worst error / tolerance per submodule and recipe",
              "Trend of the worst error / tolerance per check across runs"]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        log.warning("matplotlib is not installed: report.html has no plots (pip install pytest-npu-parity[report])")
        note = "Plots need matplotlib: pip install pytest-npu-parity[report]"
        return [(t, None, note) for t in titles]
    out = []
    for title, make in zip(titles, (_plot_err_ratio, _plot_heatmap, _plot_trend)):
        png, note = make(s, df, history)
        out.append((title, None if png is None else "data:image/png;base64," + base64.b64encode(png).decode("ascii"), note))
    return out


def trajectory_plots(df: pd.DataFrame) -> list[tuple[str, bytes]]:
    """One PNG per training-trajectory check of ``df`` (rows with ``trajectory_series``; failing checks
    first, at most ``MAX_TRAJECTORY_PLOTS``): ``[(title, png bytes)]``, the title ``"<check> [<recipe>]
    <test> — <verdict>"``. Empty without such rows or without matplotlib."""
    if TRAJECTORY_SERIES not in df.columns:
        return []
    rows = df[df[TRAJECTORY_SERIES].notna()]
    if rows.empty:
        return []
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return []
    checks = df.groupby(["test_id", "check", "recipe"], dropna=False)["verdict"].agg(
        lambda v: "fail" if v.isin(FAILING).any() else "pass")
    out = []
    order = sorted(rows.itertuples(index=False), key=lambda r: checks[(r.test_id, r.check, r.recipe)] != "fail")
    for row in order[:MAX_TRAJECTORY_PLOTS]:
        verdict = checks[(row.test_id, row.check, row.recipe)]
        limits = df[(df["test_id"] == row.test_id) & (df["check"] == row.check) & (df["recipe"] == row.recipe)]
        limits = dict(zip(limits["leaf"], limits["traj_limit"])) if "traj_limit" in limits else {}
        title = f"{row.check} [{row.recipe}] {_short_test(row.test_id).split('::', 1)[-1]} — {verdict}"
        out.append((title, _plot_trajectory(json.loads(getattr(row, TRAJECTORY_SERIES)), limits)))
    return out


def _plot_trajectory(series: Mapping[str, Any], limits: Mapping[str, Any]) -> bytes:
    names = [n for n in ("loss", "grad_norm") if n in series]
    fig = _figure(4.2 * len(names), 5.2)
    for i, name in enumerate(names):
        actual, expected = (pd.Series(v, dtype="float64") for v in series[name])
        top = fig.add_subplot(2, len(names), i + 1)
        top.plot(expected.index, expected, color="#555555", lw=1.6, label="reference")
        top.plot(actual.index, actual, color=_COLORS["fail"], lw=0.9, ls="--", label="target")
        top.set_title(name, fontsize=9)
        top.legend(fontsize=7)
        bottom = fig.add_subplot(2, len(names), len(names) + i + 1, sharex=top)
        rel = ((actual - expected).abs() / expected.abs().clip(lower=1e-300)).clip(lower=1e-12)
        bottom.semilogy(rel.index, rel, color="#90caf9", lw=0.8, label="|target − reference| / |reference|")
        bottom.semilogy(rel.index, rel.rolling(10, min_periods=1).mean(), color="#0d47a1", lw=1.4,
                        label="10-step trailing mean")
        limit = limits.get(name)
        if limit is not None and not _isna(limit):
            bottom.axhline(float(limit), color=_COLORS["fail"], lw=0.8, ls=":", label=f"limit {float(limit):g}")
        bottom.set_xlabel("step", fontsize=8)
        bottom.legend(fontsize=7)
    return _png(fig)


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _png(fig) -> bytes:
    buf = io.BytesIO()
    # Software=None drops matplotlib's URL from the PNG text chunk: the page holds no URL at all.
    fig.savefig(buf, format="png", metadata={"Software": None}, bbox_inches="tight")
    return buf.getvalue()


def _label(checks: pd.DataFrame) -> list[str]:
    base = [f"{c} [{r}]" if not _isna(r) else str(c) for c, r in zip(checks["check"], checks["recipe"])]
    dupes = {b for b in base if base.count(b) > 1}
    labels = [f"{b} {_short_test(t).split('::', 1)[-1]}" if b in dupes else b for b, t in zip(base, checks["test_id"])]
    return [lbl if len(lbl) <= 60 else lbl[:59] + "…" for lbl in labels]


def _plot_values(values: pd.Series, failing: pd.Series) -> tuple[pd.Series, float, float]:
    """Map err_ratio to plottable values: zeros to a floor, problems (NaN/inf when failing) to a ceiling."""
    finite = values[pd.notna(values) & (values > 0) & (values < math.inf)]
    floor = max(min(0.1, float(finite.min()) / 3), 1e-12) if len(finite) else RATIO_FLOOR
    ceil = max(10.0, float(finite.max()) * 3) if len(finite) else 10.0
    mapped = values.where(~((values.isna() | (values == math.inf)) & failing), ceil)
    mapped = mapped.where(~(mapped <= 0), floor)
    return mapped, floor, ceil


def _plot_err_ratio(s: Summary, df: pd.DataFrame, history):
    if df.empty:
        return None, "No rows to plot."
    checks = s.checks.head(MAX_PLOT_CHECKS)
    note = (f"The {len(checks)} worst of {len(s.checks)} checks." if len(s.checks) > len(checks) else None)
    mapped, floor, ceil = _plot_values(df["err_ratio"].astype("float64"), df["verdict"].isin(FAILING))
    frame = df.assign(_x=mapped)
    n = len(checks)
    fig = _figure(8, max(2.6, 0.3 * n + 1.3))
    ax = fig.add_subplot(1, 1, 1)
    ax.axvspan(1, ceil * 1.5, color="#c62828", alpha=0.06, lw=0)
    frame = frame.assign(_rec=frame["recipe"].astype(object).fillna(""))
    groups = {key: g for key, g in frame[frame["_x"].notna()].groupby(["test_id", "check", "_rec"], sort=False)}
    empty = frame.iloc[0:0]
    for i, c in enumerate(checks.itertuples()):
        y = n - 1 - i
        leaves = groups.get((c.test_id, c.check, "" if _isna(c.recipe) else c.recipe), empty)
        for verdict, group in leaves.groupby("verdict"):
            ax.scatter(group["_x"], [y] * len(group), s=18, color=_COLORS.get(verdict, "grey"), alpha=0.55,
                       edgecolors="none", zorder=3)
        if len(leaves):
            ax.scatter([leaves["_x"].max()], [y], s=60, marker="D", color=_COLORS.get(c.verdict, "grey"), zorder=4)
    ax.axvline(1.0, color="#c62828", ls="--", lw=1.2, zorder=2)
    ax.text(1.05, n - 0.4 if n else 0.6, "tolerance", color="#c62828", fontsize=8, va="bottom")
    ax.set_xscale("log")
    ax.set_xlim(floor / 1.5, ceil * 1.5)
    ax.set_ylim(-0.7, max(n - 0.3, 0.7))
    ax.set_yticks(range(n))
    ax.set_yticklabels(list(reversed(_label(checks))), fontsize=8)
    ax.set_xlabel("err/tol = max |actual − expected| / (atol + rtol·|expected|) per leaf\n"
                  "◆ worst leaf of the check; zeros at the left edge, structural failures at the right edge", fontsize=8)
    ax.grid(axis="x", which="major", alpha=0.3)
    fig.tight_layout()
    return _png(fig), note


def _plot_heatmap(s: Summary, df: pd.DataFrame, history):
    if df.empty:
        return None, "No rows to plot."
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.colors import TwoSlopeNorm

    frame = df.assign(
        _sub=df["submodule"].map(lambda v: "(whole model)" if _isna(v) or v == "" else v),
        _rec=df["recipe"].map(lambda v: "–" if _isna(v) else v),
        _sev=_severity(df), _bad=df["verdict"].isin(FAILING),
    )
    worst = frame.groupby(["_sub", "_rec"])["_sev"].max().unstack()
    bad = frame.groupby(["_sub", "_rec"])["_bad"].sum().unstack()
    order = worst.max(axis=1).sort_values(ascending=False).index[:MAX_PLOT_CHECKS]
    worst, bad = worst.loc[order], bad.loc[order]
    note = f"The {len(order)} worst of {frame['_sub'].nunique()} submodules." if frame["_sub"].nunique() > len(order) else None
    values = worst.to_numpy(dtype="float64")
    finite_max = np.nanmax(np.where(np.isfinite(values), values, np.nan)) if np.isfinite(values).any() else 1.0
    logv = np.log10(np.clip(np.where(np.isinf(values), max(finite_max, 10.0), values), RATIO_FLOOR, None))
    logv = np.where(values < 0, np.nan, logv)  # -1 = no ratio (e.g. passing leaves without metrics)
    vmax = max(2.0, float(np.nanmax(logv)) if np.isfinite(logv).any() else 2.0)
    rows, cols = worst.shape
    fig = _figure(min(3.2 + 1.3 * cols, 8), max(2.6, 0.3 * rows + 1.3))
    ax = fig.add_subplot(1, 1, 1)
    cmap = colormaps["RdYlGn_r"].with_extremes(bad="#eeeeee")
    image = ax.imshow(np.ma.masked_invalid(logv), cmap=cmap, aspect="auto",
                      norm=TwoSlopeNorm(vmin=math.log10(RATIO_FLOOR), vcenter=0.0, vmax=vmax))
    for i in range(rows):
        for j in range(cols):
            v = values[i, j]
            if np.isnan(v):
                text = "—"
            else:
                text = "n/a" if v < 0 else "problem" if math.isinf(v) else _num(v, 2)
                if bad.iloc[i, j]:
                    text += f"\n{int(bad.iloc[i, j])} failing"
            ax.text(j, i, text, ha="center", va="center", fontsize=7)
    ax.set_xticks(range(cols))
    ax.set_xticklabels(list(worst.columns), fontsize=9)
    ax.set_yticks(range(rows))
    ax.set_yticklabels([str(x)[:50] for x in worst.index], fontsize=8)
    ax.set_xlabel("recipe", fontsize=9)
    bar = fig.colorbar(image, ax=ax, shrink=0.8)
    bar.set_label("log10 worst err/tol (0 = tolerance)", fontsize=8)
    fig.tight_layout()
    return _png(fig), note


def _plot_trend(s: Summary, df: pd.DataFrame, history):
    if s.history is None or s.run_id is None:
        return None, "No history given: pass --parity-history PATH (or render a history file) for trend lines."
    full = s.history
    table = runs(full)
    kind = table.loc[table["run_id"] == s.run_id, "target"]
    if kind.empty:
        return None, f"Run {s.run_id} is not in the history."
    chain = table[table["target"] == kind.iloc[0]].reset_index(drop=True)
    chain = chain.iloc[: int(chain.index[chain["run_id"] == s.run_id][0]) + 1]  # up to this run
    if len(chain) < 2:
        return None, "Trend lines need at least two runs of this target in the history."
    part = full[full["run_id"].isin(chain["run_id"])]
    part = part.assign(_sev=_severity(part), _rec=part["recipe"].astype(object).fillna(""))
    per = part.groupby(["test_id", "check", "_rec", "run_id"])["_sev"].max().reset_index()
    current = per[per["run_id"] == s.run_id].sort_values("_sev", ascending=False)
    picked = list(zip(current["test_id"], current["check"], current["_rec"]))
    if s.new is not None:
        news = [(t, c, "" if _isna(r) else r) for t, c, r in zip(s.new["test_id"], s.new["check"], s.new["recipe"])]
        picked = list(dict.fromkeys(news + picked))
    picked = picked[:MAX_TREND_LINES]
    created = dict(zip(chain["run_id"], chain["created"]))
    use_dates = chain["created"].notna().all()
    xs_of = {rid: (created[rid].tz_convert("UTC").tz_localize(None).to_pydatetime() if use_dates else i)
             for i, rid in enumerate(chain["run_id"])}
    values = per["_sev"].where(per["_sev"] != -1.0)
    mapped, floor, ceil = _plot_values(values, pd.Series(True, index=per.index))
    per = per.assign(_y=mapped)
    fig = _figure(12, 3.8)
    ax = fig.add_subplot(1, 1, 1)
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    for k, (test_id, check, recipe) in enumerate(picked):
        line = per[(per["test_id"] == test_id) & (per["check"] == check) & (per["_rec"] == recipe)]
        line = line.assign(_x=line["run_id"].map(xs_of)).sort_values("_x")
        label = _label(pd.DataFrame({"check": [check], "recipe": [recipe or None], "test_id": [test_id]}))[0]
        ax.plot(list(line["_x"]), list(line["_y"]), marker="o", ms=4, lw=1.4, color=cmap(k % 10), label=label)
    ax.axhline(1.0, color="#c62828", ls="--", lw=1.2)
    ax.text(0.005, 1.08, "tolerance", color="#c62828", fontsize=8, transform=ax.get_yaxis_transform())
    ax.set_yscale("log")
    ax.set_ylim(floor / 1.5, ceil * 1.5)
    ax.set_ylabel("worst err/tol of the check", fontsize=9)
    if use_dates:
        from matplotlib.dates import DateFormatter

        ticks = list(xs_of.values())
        step = max(1, len(ticks) // 12)
        ax.set_xticks(ticks[::step])
        ax.xaxis.set_major_formatter(DateFormatter("%Y-%m-%d"))
        fig.autofmt_xdate()
    else:
        ax.set_xlabel("run (file order; no dates recorded)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    note = f"{len(chain)} runs of this target; the {len(picked)} worst checks of this run (new failures first)."
    return _png(fig), note


_CSS = """
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px;color:#1d1d1f;max-width:1800px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:3px}
.runline{color:#444;margin:0 0 12px} .note{color:#666;font-size:13px}
.cards{display:flex;gap:12px;flex-wrap:wrap;margin:12px 0}
.card{border:1px solid #ddd;border-radius:8px;padding:8px 16px;min-width:90px;text-align:center;background:#fafafa}
.card .value{font-size:24px;font-weight:600} .card .label{color:#555;font-size:12px}
.card.pass .value{color:#2e7d32} .card.fail .value{color:#c62828} .card.error .value{color:#6a1b9a}
table{border-collapse:collapse;font-size:12.5px;margin:6px 0}
th,td{border:1px solid #ddd;padding:3px 7px;text-align:left;vertical-align:top;white-space:nowrap}
.scroll{overflow-x:auto;max-width:100%} td[title]{text-decoration:underline dotted #aaa}
.row{display:flex;gap:16px;align-items:flex-start} .row figure{flex:0 1 auto;min-width:0}
th{background:#f2f2f2;position:sticky;top:0}
table.sortable th{cursor:pointer;user-select:none}
th[aria-sort=ascending]::after{content:' \\25B2'} th[aria-sort=descending]::after{content:' \\25BC'}
td[data-v]{text-align:right;font-variant-numeric:tabular-nums}
tr.fail td:first-child{color:#c62828;font-weight:600} tr.error td:first-child{color:#6a1b9a;font-weight:600}
tr.pass td:first-child{color:#2e7d32}
figure{margin:14px 0} figcaption{font-weight:600;margin-bottom:4px} img.plot{max-width:100%;border:1px solid #eee}
details{margin:8px 0} code{background:#f4f4f4;padding:0 3px}
"""

# Sort a table by the clicked header (numbers by their data-v value), and filter the results table.
_JS = """
(function () {
  function key(cell, num) {
    var v = cell.hasAttribute('data-v') ? cell.getAttribute('data-v') : cell.textContent;
    if (!num) { return v.toLowerCase(); }
    var x = parseFloat(v);
    return isNaN(x) ? -Infinity : x;
  }
  Array.prototype.forEach.call(document.querySelectorAll('table.sortable'), function (table) {
    var heads = table.tHead.rows[0].cells;
    Array.prototype.forEach.call(heads, function (th, col) {
      th.addEventListener('click', function () {
        var num = th.getAttribute('data-type') === 'num';
        var asc = th.getAttribute('aria-sort') !== 'ascending';
        Array.prototype.forEach.call(heads, function (h) { h.removeAttribute('aria-sort'); });
        th.setAttribute('aria-sort', asc ? 'ascending' : 'descending');
        var body = table.tBodies[0];
        var rows = Array.prototype.slice.call(body.rows);
        rows.sort(function (a, b) {
          var x = key(a.cells[col], num), y = key(b.cells[col], num);
          return (x < y ? -1 : x > y ? 1 : 0) * (asc ? 1 : -1);
        });
        rows.forEach(function (r) { body.appendChild(r); });
      });
    });
  });
  var filter = document.getElementById('filter');
  var results = document.getElementById('results');
  var shown = document.getElementById('shown');
  if (filter && results) {
    filter.addEventListener('input', function () {
      var q = filter.value.toLowerCase(), n = 0;
      Array.prototype.forEach.call(results.tBodies[0].rows, function (r) {
        var hit = r.textContent.toLowerCase().indexOf(q) !== -1;
        r.style.display = hit ? '' : 'none';
        n += hit ? 1 : 0;
      });
      shown.textContent = q ? n + ' rows shown' : '';
    });
  }
  document.body.setAttribute('data-ready', '1');
})();
"""
