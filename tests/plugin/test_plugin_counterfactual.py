"""What makes it pass, through pytest: a bf16 check failing under its golden verdict gets the
counterfactual section and the verified fp32-island fix in its failure message (no "not localized"
note), and the report's ``fp32_islands`` column."""
from __future__ import annotations

import csv
import shutil
import textwrap
from pathlib import Path

import pytest

# pytester forgets modules first imported during an in-process run; import what every run needs once.
import hypothesis  # noqa: F401
import pytest_npu_parity.npu  # noqa: F401
import pytest_npu_parity.runner  # noqa: F401

MODELS = Path(__file__).parents[1] / "diagnose" / "counterfactual_models.py"

SUITE = """
import pytest

from counterfactual_models import fragile_moments, norm_input, norm_net


@pytest.fixture
def parity_patches():
    return fragile_moments


def test_norm(parity):
    parity.check("norm", norm_net(), norm_input())
"""


def _project(pytester: pytest.Pytester) -> None:
    pytester.makeini("""
        [pytest]
        parity_dtypes = bf16
    """)
    suite = pytester.path / "parity_suites" / "demo"
    suite.mkdir(parents=True)
    shutil.copy(MODELS, suite / "counterfactual_models.py")
    (suite / "test_fragile.py").write_text(textwrap.dedent(SUITE))


def test_a_bf16_golden_failure_gets_the_verified_fp32_island(pytester: pytest.Pytester) -> None:
    _project(pytester)
    result = pytester.runpytest("--npu-parity", "--parity-reference=cpu", "-p", "no:randomly",
                                "--parity-report=report", "parity_suites")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "failed under the golden policy" in out and "not run under the golden verdict" not in out
    result.stdout.fnmatch_lines(["*What makes it pass (* re-run(s) of the target*",
                                 "*blocks.1 (NormBlock) replaced by its float64 CPU reference*ROOT CAUSE*",
                                 "*Precision islands: the check passes with blocks.1.norm in float32*verified*",
                                 '*pytest_npu_parity.fp32_islands(model, [[]"blocks.1.norm"])*'])  # [[] is a literal [
    result.stdout.fnmatch_lines(["what makes it pass: 1 failing check re-run counterfactually in * s, "
                                 "1 verified fp32-island fix"])
    rows = list(csv.DictReader((pytester.path / "report" / "results.csv").open()))
    assert rows[0]["fp32_islands"] == "blocks.1.norm" and "root cause" in rows[0]["counterfactual"]
