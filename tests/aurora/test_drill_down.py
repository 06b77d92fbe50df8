"""The drill-down a failing Aurora trajectory forecast gives: NPU_PARITY_AURORA_WINDOW runs the tensor-level
checks on one held-out El Nino window (checks.suite_batch, checks.DRILL_DOWN)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_npu_parity.aurora import checks, inputs

REPO = Path(__file__).resolve().parents[2]


def test_the_window_replaces_the_suite_batch(monkeypatch):
    monkeypatch.setenv(checks.WINDOW_ENV, "elnino 1956-06")
    batch = checks.suite_batch()
    assert batch.start_dates == ["1956-06-01"] * inputs.BATCH and batch.horizons == (80, 96)
    assert batch.context.shape == (inputs.BATCH, inputs.CONTEXT) and "El Nino" in batch.texts[0]
    assert abs(float(batch.context[0].mean())) < 1e-5  # standardized like the CO2 batch


@pytest.mark.parametrize("value", ["co2 1956-06", "elnino 1956", "elnino 2020-01", "elnino 2010-12"])
def test_a_bad_window_names_the_variable_or_the_month(monkeypatch, value):
    monkeypatch.setenv(checks.WINDOW_ENV, value)
    with pytest.raises(ValueError, match=r"NPU_PARITY_AURORA_WINDOW|El Nino month|do not fit"):
        checks.suite_batch()


def test_the_drill_down_command_runs_the_checks_on_that_window():
    # the command the message prints, on the training-step test (the tiny model: a few seconds)
    command = checks.DRILL_DOWN.format(window="elnino 1956-06")
    assert command.startswith("NPU_PARITY_AURORA_WINDOW='elnino 1956-06' pytest --npu-parity --parity-reference cpu ")
    env = dict(os.environ, NPU_PARITY_AURORA_WINDOW="elnino 1956-06", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--npu-parity",
                           "--parity-reference", "cpu", "--parity-dtypes", "fp32",
                           "parity_suites/aurora/test_train_step.py"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "1 passed" in done.stdout
