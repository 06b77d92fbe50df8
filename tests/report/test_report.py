"""Tests of pytest_npu_parity.report / report_html: the results table, summary, history, HTML, CLI."""
from __future__ import annotations

import base64
import importlib.util
import json
import math
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import numpy as np
import pandas as pd
import pytest
import torch
from locations import REPO

from pytest_npu_parity import report
from pytest_npu_parity.report import columns as report_columns
from pytest_npu_parity.report import history as report_history
from pytest_npu_parity.compare import compare
from pytest_npu_parity.policy import FP32, LOW_PRECISION



# --------------------------------------------------------------------------------------------
# known comparisons, measured by hand in float64


def _known(actual: list[float], expected: list[float], rtol: float, atol: float) -> dict:
    a = np.asarray(np.float32(actual), dtype=np.float64).ravel()
    e = np.asarray(np.float32(expected), dtype=np.float64).ravel()
    d = np.abs(a - e)
    allowed = atol + rtol * np.abs(e)
    return {
        "max_abs": d.max(), "max_rel": (d / (np.abs(e) + 1e-10)).max(),
        "rel_l2": np.linalg.norm(a - e) / np.linalg.norm(e),
        "cosine": a @ e / (np.linalg.norm(a) * np.linalg.norm(e)),
        "err_ratio": (d / allowed).max(), "mismatched": int((d > allowed).sum()),
    }


# Pair A passes (worst element 2e-5 against 1e-5 + 1e-5*2), pair B fails (1e-3 against 2e-5).
PAIR_A = ([[1.0, 2.00002], [-4.00001, 0.5]], [[1.0, 2.0], [-4.0, 0.5]])
PAIR_B = ([1.0, 1.001], [1.0, 1.0])


def _rows_of(name, actual, expected, tol, **fields):
    result = compare(torch.tensor(actual), torch.tensor(expected), tol, name=name)
    rows = []
    for leaf in result.leaves:
        row = leaf.to_row()
        row.update(check=name, **fields)
        rows.append(row)
    return rows


def _meta(run_id="night-1", created="2025-03-01T02:00:00+00:00", **changes):
    meta = {
        "run_id": run_id, "created": created, "git_revision": "0123456789abcdef", "machine": "ascend-01 (aarch64)",
        "python": "3.10.14", "torch": "2.5.1", "torch_npu": "2.5.1", "cann": "8.2.RC1", "transformers": "4.57.6",
        "aurora_model": "0.2.0", "plugin_version": "0.1.0", "target": "npu:0", "target_name": "Ascend910B3",
        "reference": "cpu", "recipes": ["fp32", "bf16"],
        "precision_flags": {"npu.conv.allow_hf32": False, "npu.matmul.allow_hf32": False},
        "patch_set": ["resample_pinv_cpu", "causal_mask_device"], "pytest_args": "--npu-parity parity_suites/aurora",
    }
    meta.update(changes)
    return meta


def _base(test, recipe="fp32", **extra):
    row = {"test_id": f"parity_suites/aurora/test_layers.py::{test}[{recipe}]", "submodule": "model.dec_layers.0",
           "suite": "aurora", "recipe": recipe, "target": "npu:0", "target_name": "Ascend910B3", "reference": "cpu",
           "reference_provenance": "live CPU run, torch 2.5.1"}
    row.update(extra)
    return row


def _known_rows():
    rows = _rows_of("dec_a", *PAIR_A, FP32, **_base("test_a", audit_h2d=2, duration_s=0.25))
    rows += _rows_of("dec_b", *PAIR_B, FP32, **_base("test_b"))
    return rows


def _simple(test, check, verdict, err_ratio, recipe="fp32", target="npu:0", leaf="out"):
    return {"test_id": f"t.py::{test}", "check": check, "leaf": leaf, "recipe": recipe, "suite": "aurora",
            "submodule": check, "target": target, "verdict": verdict, "err_ratio": err_ratio,
            "max_abs": err_ratio * 1e-5, "rtol": 1e-5, "atol": 1e-5, "budget": 0.0, "tolerance_source": "default"}


# --------------------------------------------------------------------------------------------
# the row contract


def test_columns_are_the_documented_contract():
    expected = ("run_id test_id check leaf submodule suite recipe dtype shape numel target target_name reference "
                "reference_provenance max_abs max_rel rel_l2 cosine err_ratio mismatched mismatched_frac "
                "nonfinite_mismatched rtol atol budget tolerance_source tolerance_reason policy golden_policy policy_note "
                "golden_dtype golden_worst_metric golden_worst_margin msprobe_cosine msprobe_euc_dist msprobe_max_abs_err "
                "msprobe_max_rel_err msprobe_one_thousandth msprobe_five_thousandths msprobe_note golden_msprobe_verdict "
                "distribution_policy dist_sample_dim dist_groups dist_samples dist_expected_samples dist_features "
                "dist_pvalue dist_alpha dist_permutations dist_mean_shift dist_quantile_shift dist_spread_ratio "
                "dist_mean dist_mean_pvalue dist_spread dist_spread_pvalue dist_quantiles dist_quantiles_pvalue "
                "dist_energy dist_energy_pvalue problem verdict "
                "audit_mixed_device audit_h2d audit_d2h audit_host_sync audit_cpu_fallback audit_fp64 audit_budget audit_problem "
                "audit_verdict duration_s").split()
    assert list(report.COLUMNS) == expected
    for name, text in {**report.COLUMNS, **report.META_COLUMNS}.items():
        assert text and "\n" not in text, name
    # every metric column of the comparison engine is part of the contract
    assert set(_known_rows()[0]) <= set(report.COLUMNS)


def test_the_columns_reference_page_is_generated_from_the_column_tables():
    page = REPO / "docs" / "reference" / "report-columns.md"
    assert page.exists() and page.read_text(encoding="utf-8") == report_columns.reference_markdown(), (
        f"{page.relative_to(REPO)} differs from the column tables of pytest_npu_parity/report/columns.py; "
        "regenerate it with: python -m pytest_npu_parity.report.columns > docs/reference/report-columns.md")
    for table in (report_columns.ROW_TABLE, report_columns.META_TABLE, report_columns.EXTRA_TABLE):
        for column in table:
            assert f"| `{column.name}` |" in page.read_text(encoding="utf-8"), column.name


def test_to_frame_names_missing_required_columns_and_bad_verdicts():
    with pytest.raises(ValueError, match=r"\['verdict'\]"):
        report.to_frame([{"test_id": "t", "check": "c", "leaf": ""}])
    with pytest.raises(ValueError, match="'passed' of t / c"):
        report.to_frame([{"test_id": "t", "check": "c", "leaf": "", "verdict": "passed"}])
    with pytest.raises(TypeError, match="list of dicts"):
        report.to_frame("results.csv")


def test_suite_defaults_to_the_parity_suites_folder_or_the_test_file():
    rows = [{"test_id": "parity_suites/aurora/test_layers.py::test_x[fp32]", "check": "c", "leaf": "", "verdict": "pass"},
            {"test_id": "tests/test_model.py::test_y", "check": "c", "leaf": None, "verdict": "error"},
            {"test_id": "t.py::z", "check": "c", "leaf": "", "verdict": "pass", "suite": "mine"}]
    df = report.to_frame(rows)
    assert df["suite"].tolist() == ["aurora", "test_model", "mine"]
    assert df["leaf"].tolist() == ["", "", ""]


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_results_table_holds_known_comparisons_and_run_metadata(tmp_path, fmt):
    meta = _meta()
    paths = report.write_report(_known_rows(), meta, tmp_path / "out")
    assert set(paths) == {"parquet", "csv", "meta", "summary", "html"}
    df = pd.read_parquet(paths["parquet"]) if fmt == "parquet" else pd.read_csv(paths["csv"])
    assert list(df.columns[: len(report.COLUMNS)]) == list(report.COLUMNS)
    assert set(report.META_COLUMNS) <= set(df.columns)
    assert len(df) == 2
    a = df[df["check"] == "dec_a"].iloc[0]
    b = df[df["check"] == "dec_b"].iloc[0]
    for row, pair in ((a, PAIR_A), (b, PAIR_B)):
        known = _known(*pair, rtol=1e-5, atol=1e-5)
        for key in ("max_abs", "max_rel", "rel_l2", "cosine", "err_ratio"):
            assert row[key] == pytest.approx(known[key], rel=1e-9, abs=1e-15), key
        assert row["mismatched"] == known["mismatched"]
    assert (a["verdict"], b["verdict"]) == ("pass", "fail")
    assert a["err_ratio"] < 1 < b["err_ratio"]
    assert (a["dtype"], a["shape"], a["numel"]) == ("float32", "2x2", 4)
    assert (a["rtol"], a["atol"], a["budget"], a["tolerance_source"]) == (1e-5, 1e-5, 0.0, "default")
    assert a["audit_h2d"] == 2 and a["duration_s"] == 0.25
    assert pd.isna(b["audit_h2d"]) and pd.isna(b["duration_s"])  # optional columns may be missing
    assert (a["run_id"], a["cann"], a["target_name"]) == ("night-1", "8.2.RC1", "Ascend910B3")
    assert json.loads(a["precision_flags"]) == meta["precision_flags"]
    assert json.loads(a["patch_set"]) == meta["patch_set"]
    assert json.loads(paths["meta"].read_text()) == meta
    # the runner gives pytest_args as a list: stored as JSON text, read back as the list
    listed = report.to_frame(_known_rows(), _meta(pytest_args=["--npu-parity", "parity_suites/aurora"]))
    assert report.meta_from_frame(listed)["pytest_args"] == ["--npu-parity", "parity_suites/aurora"]
    # the same table comes back through the loader, with its metadata
    loaded = report.load_history(paths[fmt])
    assert report.meta_from_frame(loaded)["patch_set"] == meta["patch_set"]
    assert loaded["err_ratio"].tolist() == pytest.approx(df["err_ratio"].tolist())


def test_parquet_is_skipped_with_a_warning_without_pyarrow(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(report_history, "_have_pyarrow", lambda: False)  # looked up there by write and append
    paths = report.write_report(_known_rows(), _meta(), tmp_path)
    assert "parquet" not in paths and not (tmp_path / "results.parquet").exists()
    assert paths["csv"].exists()
    assert "pyarrow is not installed" in caplog.text
    with pytest.raises(ImportError, match=r"pyarrow.*\.csv"):
        report.append_history(_known_rows(), _meta(), tmp_path / "h.parquet")


# --------------------------------------------------------------------------------------------
# summary


def test_summary_markdown_counts_worst_first_and_overrides():
    rows = _known_rows()
    rows += _rows_of("dec_c", *PAIR_A, LOW_PRECISION.replace(atol=2e-3, source="marker", reason="3 bf16 matmuls | fused"),
                     **_base("test_c", recipe="bf16"))
    text = report.summary_markdown(rows, _meta(reference="auto"))
    assert "vs reference cpu;" in text  # the references the rows used, not the "auto" setting
    assert text.startswith("## ❌ NPU parity: 2 passed, 1 failed, 0 errors of 3 checks (3 leaves)")
    assert "| aurora | bf16 | 1 | 1 | 0 | 0 |" in text
    assert "| aurora | fp32 | 2 | 1 | 1 | 0 |" in text
    worst = text.split("### Worst checks")[1].splitlines()
    first = next(line for line in worst if line.startswith("| ❌"))
    known_b = _known(*PAIR_B, rtol=1e-5, atol=1e-5)
    assert "dec_b" in first and f"| {known_b['err_ratio']:.3g} |" in first
    assert "No history given" in text
    assert "3 bf16 matmuls \\| fused" in text  # pipes in cells are escaped
    assert "`npu.conv.allow_hf32=False`" in text and "`resample_pinv_cpu`" in text
    assert "8.2.RC1" in text and "Ascend910B3" in text
    for line in text.splitlines():
        if line.startswith("|"):
            assert line.endswith("|")


def test_recording_runs_and_errors_without_metrics():
    """Rows as the runner makes them when nothing was compared: a recorded baseline, an error."""
    rows = [{"test_id": "parity_suites/aurora/test_layers.py::test_x[fp32]", "check": "enc", "leaf": None,
             "recipe": "fp32", "verdict": "recorded", "reference": "recorded", "rtol": 1e-5, "atol": 1e-5},
            {"test_id": "parity_suites/aurora/test_layers.py::test_y[fp32]", "check": "dec", "leaf": None,
             "recipe": "fp32", "verdict": "error", "problem": "RuntimeError: no kernel for aten::fft_rfft"}]
    text = report.summary_markdown(rows, _meta())
    assert "0 passed, 0 failed, 1 errors, 1 baselines recorded of 2 checks" in text
    assert "| aurora | fp32 | 2 | 0 | 0 | 1 | 1 | inf |" in text  # the error ranks worst
    assert "(RuntimeError: no kernel for aten::fft_rfft)" in text
    assert not re.search(r"\| -1 \||\(nan\)|\bnan\b", text)
    html = report.render_html(rows, _meta())
    assert ">recorded<" in html and "no kernel for aten::fft_rfft" in html


def test_summary_of_an_empty_run():
    text = report.summary_markdown([], _meta())
    assert "0 checks" in text and "No parity checks ran." in text


# --------------------------------------------------------------------------------------------
# history: two simulated nights


NIGHT_1 = [_simple("test_a", "a", "pass", 0.4), _simple("test_b", "b", "fail", 3.0), _simple("test_c", "c", "pass", 0.2)]
NIGHT_2 = [_simple("test_a", "a", "fail", 2.5), _simple("test_b", "b", "fail", 3.5), _simple("test_c", "c", "pass", 0.3),
           _simple("test_d", "d", "error", math.nan)]


@pytest.mark.parametrize("suffix", [".parquet", ".csv"])
def test_history_append_and_new_failures_across_two_nights(tmp_path, suffix):
    path = tmp_path / "hist" / f"history{suffix}"
    h1 = report.append_history(NIGHT_1, _meta("n1", "2025-03-01T02:00:00+00:00", torch="2.5.1"), path)
    assert len(h1) == 3 and set(h1["run_id"]) == {"n1"}
    new1 = report.new_failures(h1, "n1")  # first night: every failure is new
    assert new1["check"].tolist() == ["b"] and new1["previous_verdict"].tolist() == ["absent"]

    h2 = report.append_history(NIGHT_2, _meta("n2", "2025-03-02T02:00:00+00:00", torch="2.6.0"), path)
    assert len(h2) == 7 and report.runs(h2)["run_id"].tolist() == ["n1", "n2"]
    on_disk = report.load_history(path)
    assert len(on_disk) == 7
    assert on_disk.groupby("run_id")["torch"].first().to_dict() == {"n1": "2.5.1", "n2": "2.6.0"}
    assert not list(path.parent.glob("*.tmp"))  # atomic write leaves no temporary file

    new = report.new_failures(on_disk, "n2")
    assert new["check"].tolist() == ["d", "a"]  # error (no ratio) first, then by err/tol
    by_check = new.set_index("check")
    assert by_check.loc["a", "previous_verdict"] == "pass" and by_check.loc["a", "previous_err_ratio"] == 0.4
    assert by_check.loc["d", "previous_verdict"] == "absent"
    assert set(new["previous_run_id"]) == {"n1"}

    since = report.failing_since(on_disk, "n2").set_index("check")
    assert since.loc["b", "since_run_id"] == "n1" and since.loc["b", "runs_failing"] == 2
    assert since.loc["a", "since_run_id"] == "n2" and since.loc["a", "runs_failing"] == 1

    text = report.summary_markdown(NIGHT_2, _meta("n2", "2025-03-02T02:00:00+00:00"), on_disk)
    section = text.split("### New failures since the previous run")[1].split("###")[0]
    assert "Compared with run `n1` at 2025-03-01 02:00 UTC: 2 new failing leaves." in section
    assert "| t.py::test_a | a | out | fp32 | 2.5 | pass (0.4) |" in section
    assert "| t.py::test_d | d | out | fp32 | – | absent |" in section
    assert "test_b" not in section
    assert "2025-03-01 02:00 UTC |" in text.split("### Worst checks")[1]  # b has failed since night 1

    # re-appending a run replaces it instead of duplicating it
    assert len(report.append_history(NIGHT_2, _meta("n2", "2025-03-02T02:00:00+00:00"), path)) == 7


def test_previous_run_is_that_of_the_same_target_type(tmp_path):
    path = tmp_path / "h.csv"
    report.append_history(NIGHT_1, _meta("npu-1", "2025-03-01T02:00:00+00:00"), path)
    cpu = [dict(r, target="cpu", verdict="pass") for r in NIGHT_2]
    report.append_history(cpu, _meta("cpu-1", "2025-03-01T03:00:00+00:00", target="cpu"), path)
    night2 = [dict(r, target="npu:1") for r in NIGHT_2]  # another card of the same kind
    history = report.append_history(night2, _meta("npu-2", "2025-03-02T02:00:00+00:00", target="npu:1"), path)
    assert report.previous_run(history, "npu-2") == "npu-1"
    assert report.previous_run(history, "cpu-1") is None
    assert set(report.new_failures(history, "npu-2")["check"]) == {"a", "d"}
    html = report.render_html(night2, _meta("npu-2", "2025-03-02T02:00:00+00:00", target="npu:1"), history)
    assert "2 runs of this target" in html  # the CPU run is not on the NPU trend
    assert "Trend lines need at least two runs" in report.render_html(cpu, _meta("cpu-1", target="cpu"), history)
    with pytest.raises(ValueError, match="'nope' is not in the history"):
        report.new_failures(history, "nope")


def test_history_keep_runs_and_bad_paths(tmp_path):
    path = tmp_path / "h.parquet"
    for day in (1, 2, 3):
        history = report.append_history(NIGHT_1, _meta(f"n{day}", f"2025-03-0{day}T02:00:00+00:00"), path, keep_runs=2)
    assert report.runs(history)["run_id"].tolist() == ["n2", "n3"]
    with pytest.raises(ValueError, match=r"\.parquet or \*\.csv"):
        report.append_history(NIGHT_1, _meta(), tmp_path / "h.json")
    with pytest.raises(ValueError, match="lacks 'created'"):
        report.append_history(NIGHT_1, _meta(created=None), path)
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match=r"bad\.csv.*required column"):
        report.load_history(tmp_path / "bad.csv")


# --------------------------------------------------------------------------------------------
# JUnit properties


def test_junit_properties_carry_the_worst_leaf_metrics():
    rows = _rows_of("dec_b", *PAIR_B, FP32, **_base("test_b"))
    props = dict(report.junit_properties(rows))
    known = _known(*PAIR_B, rtol=1e-5, atol=1e-5)
    assert props["parity.dec_b.verdict"] == "fail"
    assert float(props["parity.dec_b.err_ratio"]) == pytest.approx(known["err_ratio"], rel=1e-5)
    assert float(props["parity.dec_b.max_abs"]) == pytest.approx(known["max_abs"], rel=1e-5)
    assert props["parity.dec_b.mismatched"] == "1" and props["parity.dec_b.numel"] == "2"
    assert props["parity.dec_b.tolerance"] == "rtol=1e-05 atol=1e-05 budget=0"
    assert props["parity.dec_b.reference"] == "cpu: live CPU run, torch 2.5.1"
    assert all(isinstance(v, str) for v in props.values())
    two = report.junit_properties(rows + [dict(r, recipe="bf16") for r in rows])
    assert {"parity.dec_b.fp32.verdict", "parity.dec_b.bf16.verdict"} <= dict(two).keys()
    assert report.junit_properties([]) == []
    suite = dict(report.junit_suite_properties(_meta()))
    assert suite["parity.cann"] == "8.2.RC1" and json.loads(suite["parity.patch_set"])[0] == "resample_pinv_cpu"


def test_user_properties_reach_the_testcase_under_default_xunit2(pytester):
    """The mechanism junit_properties documents: item.user_properties, no record_property warning."""
    rows = _rows_of("dec_b", *PAIR_B, FP32, **_base("test_b"))
    (pytester.path / "rows.json").write_text(json.dumps(rows))
    pytester.makeconftest("""
        import json, pathlib
        import pytest
        from pytest_npu_parity.report import junit_properties
        ROWS = json.loads((pathlib.Path(__file__).parent / "rows.json").read_text())

        @pytest.fixture
        def parity_like(request):  # as the plugin's fixture would: add them after the test body ran
            yield
            request.node.user_properties.extend(junit_properties(ROWS))
    """)
    pytester.makepyfile("def test_one(parity_like):\n    assert False, 'out of tolerance'\n")
    # No `-W error::pytest.PytestWarning`: in a long in-process session the package is already
    # imported, and pytest's "cannot be rewritten" warning would then abort the inner run. The
    # warning that matters (record_property under xunit2) is checked for by text instead.
    result = pytester.runpytest("-p", "no:npu_parity", "-p", "no:cacheprovider", "--junitxml=out.xml")
    result.assert_outcomes(failed=1)
    assert "incompatible with junit_family" not in result.stdout.str()
    tree = ET.parse(pytester.path / "out.xml")
    case = tree.find(".//testcase")
    props = {p.get("name"): p.get("value") for p in case.find("properties")}
    assert props["parity.dec_b.verdict"] == "fail"
    assert float(props["parity.dec_b.err_ratio"]) > 1
    assert "file" not in case.attrib  # xunit2 (the default family) was in force


# --------------------------------------------------------------------------------------------
# HTML


def _pngs(html: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)]


def test_html_is_self_contained_with_plots_and_sortable_table(tmp_path):
    path = tmp_path / "h.parquet"
    report.append_history(NIGHT_1, _meta("n1", "2025-03-01T02:00:00+00:00"), path)
    history = report.append_history(NIGHT_2, _meta("n2", "2025-03-02T02:00:00+00:00"), path)
    html = report.render_html(NIGHT_2, _meta("n2", "2025-03-02T02:00:00+00:00"), history)
    assert html.startswith("<!DOCTYPE html>") and html.rstrip().endswith("</html>")
    assert not re.search(r"https?://|ftp://|(src|href)=\"//", html)
    assert not re.search(r"<(link|iframe|object|embed)\b", html) and " src=\"data:" in html
    pngs = _pngs(html)
    assert len(pngs) == 3  # err/tol per check, submodule x recipe heatmap, trend lines
    assert all(p.startswith(b"\x89PNG\r\n\x1a\n") and b"matplotlib.org" not in p for p in pngs)
    body = html.split('id="results"')[1].split("</table>")[0]
    assert body.count("<tr") == 1 + len(NIGHT_2)
    assert 'class="sortable"' in html and "addEventListener('click'" in html
    assert "2 new failing leaves" in html


def test_html_without_history_or_matplotlib(monkeypatch):
    html = report.render_html(NIGHT_1, _meta())
    assert len(_pngs(html)) == 2 and "No history given" in html
    real_import = __import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr("builtins.__import__", no_matplotlib)
    html = report.render_html(NIGHT_1, _meta())
    assert not _pngs(html) and html.count("Plots need matplotlib") == 3 and 'id="results"' in html


# --------------------------------------------------------------------------------------------
# command line


def test_cli_rerenders_results_and_history(tmp_path, capsys):
    out = tmp_path / "night2"
    history_path = tmp_path / "history.csv"
    report.append_history(NIGHT_1, _meta("n1", "2025-03-01T02:00:00+00:00"), history_path)
    history = report.append_history(NIGHT_2, _meta("n2", "2025-03-02T02:00:00+00:00"), history_path)
    report.write_report(NIGHT_2, _meta("n2", "2025-03-02T02:00:00+00:00"), out, history=history)

    again = tmp_path / "again"
    assert report.main([str(out / "results.parquet"), "-o", str(again), "--history", str(history_path)]) == 0
    assert (again / "summary.md").read_text() == (out / "summary.md").read_text()
    assert json.loads((again / "meta.json").read_text())["patch_set"] == _meta()["patch_set"]

    from_history = tmp_path / "from-history"
    assert report.main([str(history_path), "-o", str(from_history), "--run", "n1"]) == 0
    summary = (from_history / "summary.md").read_text()
    assert "Run `n1`" in summary and "First run of this target" in summary
    assert report.main([str(history_path), "-o", str(from_history)]) == 0
    assert "Compared with run `n1`" in (from_history / "summary.md").read_text()

    capsys.readouterr()
    assert report.main([str(tmp_path / "missing.parquet"), "-o", str(tmp_path / "x")]) == 2
    assert "missing.parquet does not exist" in capsys.readouterr().err
    assert report.main([str(history_path), "-o", str(tmp_path / "x"), "--run", "n9"]) == 2
    assert "run 'n9' is not in" in capsys.readouterr().err


def test_cli_through_the_package_dispatcher(tmp_path):
    report.write_report(_known_rows(), _meta(), tmp_path / "in")
    proc = subprocess.run([sys.executable, "-m", "pytest_npu_parity", "report", str(tmp_path / "in"), "-o", str(tmp_path / "out")],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / "report.html").exists() and "summary" in proc.stdout


# --------------------------------------------------------------------------------------------
# the nightly workflow


def test_nightly_workflow_is_valid_yaml_running_the_documented_commands():
    yaml = pytest.importorskip("yaml")
    path = REPO / ".github" / "workflows" / "nightly-parity.yml"
    workflow = yaml.safe_load(path.read_text())
    on = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` key as True
    assert on["schedule"][0]["cron"] and "workflow_dispatch" in on
    npu, cpu = workflow["jobs"]["npu"], workflow["jobs"]["cpu"]
    assert "self-hosted" in npu["runs-on"] and "ascend" in npu["runs-on"]
    assert str(cpu["runs-on"]).startswith("ubuntu")

    def script(job):
        return "\n".join(step.get("run", "") for step in job["steps"])

    npu_run, cpu_run = script(npu), script(cpu)
    assert "set_env.sh" in npu_run
    for run in (npu_run, cpu_run):
        assert re.search(r"pytest --npu-parity parity_suites/aurora .*--parity-report \S+ .*--parity-history \S+", run.replace("\\\n", " "))
        assert "GITHUB_STEP_SUMMARY" in run
    assert "--parity-reference baseline" in cpu_run
    # the NPU job compares with the committed baselines and with a live CPU run, as it says
    assert "--parity-reference baseline" in npu_run and "--parity-reference cpu" in npu_run
    assert "baselines" in npu["name"] and "live CPU" in npu["name"]
    # the nightly hypothesis profile is used where device propagation is checked
    for run in (npu_run, cpu_run):
        assert "--hypothesis-profile nightly" in run
    # the torch_npu wheel can come from Ascend's download pages (the guide) or the index
    assert "TORCH_NPU_WHEEL" in yaml.safe_dump(npu)
    uploads = [s for job in (npu, cpu) for s in job["steps"] if str(s.get("uses", "")).startswith("actions/upload-artifact")]
    assert len(uploads) >= 2
    page = REPO / "docs" / "how-to" / "nightly-report.md"
    if page.exists() and "nightly-parity.yml" in page.read_text():
        text = page.read_text()
        for line in re.findall(r"^\s*(pytest --npu-parity parity_suites/aurora[^\n]*)", npu_run + "\n" + cpu_run, re.M):
            assert line.strip().rstrip("\\").strip() in text, f"{page.name} lacks the workflow command {line.strip()!r}"


# --------------------------------------------------------------------------------------------
# headless Chromium


def _render_check_module():
    spec = importlib.util.spec_from_file_location("render_report_check", REPO / "scripts" / "render_report_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_report_renders_in_headless_chromium(tmp_path):
    check = _render_check_module()
    if check.find_chromium() is None:
        pytest.skip("Chromium is not installed (apt-get install chromium)")
    html = check.demo_report(tmp_path / "demo")
    result = check.check_report(html, screenshot=tmp_path / "shot.png")
    assert result.ok, result.problems
    assert result.probe["plots_decoded"] == 3 and result.probe["result_rows"] > 10
    assert (tmp_path / "shot.png").read_bytes().startswith(b"\x89PNG")

    # the check can fail: a console error, a script error and an external image are all caught
    bad = tmp_path / "bad.html"
    bad.write_text('<!DOCTYPE html><html><body><img src="https://example.com/x.png">'
                   '<script>console.error("boom"); missing();</script></body></html>')
    result = check.check_report(bad)
    text = "\n".join(result.problems)
    assert not result.ok
    assert '"boom"' in text and "missing is not defined" in text
    assert "network request from the page: https://example.com/x.png" in text


def test_msprobe_view_columns_round_trip(tmp_path):
    """The msprobe view's columns (floats, None where msprobe writes a marker) survive csv and parquet."""
    import torch

    from pytest_npu_parity.compare import compare

    res = compare({"x": torch.tensor([1.0, 2.0, 3.0]), "s": torch.tensor(2.0)},
                  {"x": torch.tensor([1.0, 2.5, 3.0]), "s": torch.tensor(1.0)}, FP32)
    rows = [{**leaf.to_row(), "test_id": "t.py::t", "check": "c"} for leaf in res.leaves]
    df = report.to_frame(rows)
    assert df["msprobe_cosine"].dtype == "float64"
    for name in ("r.csv", "r.parquet"):
        if name.endswith("parquet"):
            pytest.importorskip("pyarrow")
        report._write_table(df, tmp_path / name)
        back = report.load_history(tmp_path / name)
        x, s = back.set_index("leaf").loc["x"], back.set_index("leaf").loc["s"]
        # 0.5 / 2.5 in float32, to 12 decimals, as msprobe computes it
        assert x["msprobe_max_abs_err"] == 0.5 and x["msprobe_max_rel_err"] == 0.20000000298 and pd.isna(x["msprobe_note"])
        assert pd.isna(s["msprobe_cosine"]) and s["msprobe_note"].startswith("cosine=unsupported")
    table = report.check_table(df)
    assert table.loc[0, "msprobe_max_rel_err"] == 1.0  # the 0-d leaf: |2 - 1| / 1


def test_audit_totals_count_each_check_once_and_the_summary_lists_events_beyond_budget():
    """Audit counts are per check, repeated on each leaf row: the summary counts events, not leaves."""
    out = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0]), "c": torch.tensor([4.0])}
    problem = ("Device-propagation audit of check 'dec_a' on npu:0: 1 event beyond its audit budget: "
               "mixed_device 1 (allowed 0).\n"
               "  mixed-device op aten::add.Tensor: npu:0 + cpu float32 at model.py:9  x + torch.ones(4)\n"
               "Fix these lines (create tensors on the input's device: device=x.device), or allow them.")
    result = compare(out, out, FP32, name="dec_a")
    rows = [dict(leaf.to_row(), check="dec_a", **_base("test_a", audit_mixed_device=1, audit_h2d=0, audit_d2h=0,
                                                       audit_host_sync=2, audit_cpu_fallback=0, audit_fp64=0,
                                                       audit_problem=problem, audit_budget="mixed_device 0",
                                                       audit_verdict="fail"))
            for leaf in result.leaves]
    assert len(rows) == 3
    s = report.summarize(rows, _meta())
    assert s.audit_totals == {"mixed_device": 1, "h2d": 0, "d2h": 0, "host_sync": 2, "cpu_fallback": 0, "fp64": 0}
    text = report.summary_markdown(rows, _meta())
    assert "each check counted once: mixed_device 1, h2d 0, d2h 0, host_sync 2" in text
    assert "1 check with events beyond their audit budget" in text
    assert ("| ❌ failed | test_layers.py::test_a[fp32] | dec_a | fp32 | "
            "`mixed-device op aten::add.Tensor: npu:0 + cpu float32 at model.py:9  x + torch.ones(4)` |") in text
    assert text.count("mixed-device op aten::add.Tensor") == 1  # once, not once per leaf


def test_run_line_names_the_thread_counts_and_leaves_out_absent_versions():
    line = report.run_line(_meta(aurora_model=None, threads=2, interop_threads=1))
    assert "2 torch threads (1 inter-op)" in line and "aurora_model" not in line
    assert "aurora_model 0.2.0" in report.run_line(_meta())
