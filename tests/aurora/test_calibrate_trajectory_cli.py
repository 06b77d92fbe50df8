"""benchmarks/calibrate_trajectory.py's command line: a recipe or variant that runs nothing is refused before any
file is written, not a silent empty run."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
import calibrate_trajectory as CT  # noqa: E402


@pytest.mark.parametrize("argv, says", [
    (["--recipes", "bf16_weights"], "unknown recipe(s) bf16_weights"),
    (["--variants", "no_master_weights", "--recipes", "fp32"], "no row to run"),
    (["--variants", "clean", "--recipes", "fp16", "--steps", "300"], "no row to run"),
    (["--variants", "nosuch"], "unknown variant(s) nosuch"),
])
def test_arguments_that_run_nothing_are_refused(tmp_path, capsys, argv, says):
    out = ["--json", str(tmp_path / "c.json"), "--md", str(tmp_path / "c.md")]
    with pytest.raises(SystemExit) as exit_:
        CT.main(["--label", "t", *argv, *out])
    assert exit_.value.code == 2 and says in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
