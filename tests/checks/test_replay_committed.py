"""Baselines recorded on another machine: the GPT-2 and tagger examples of docs/tutorial/own-model.md,
recorded once (fp32 and bf16) on an AMD EPYC with AVX-512 under torch 2.14.1 and committed under
``tests/data/replay_baselines/``, compared wherever these tests run: CI's torch 2.14.1 and torch 2.5.1
legs, any CPU, and here also under ``ATEN_CPU_CAPABILITY=default``. A check whose machine draws other
last bits replays the recorded inputs and weights (its note says so); none may be stale.

Re-record them (after a deliberate change of the examples) with the commands in ``RECORD``.
"""
from __future__ import annotations

import shutil

import pytest
from cpu_features import NO_BF16_LSTM, runs_bf16_lstm
from locations import TESTS
from test_own_models import EXAMPLES

COMMITTED = TESTS / "data" / "replay_baselines"
FILES = ["test_gpt2.py", "test_tagger.py"]
RECORD = ("in an empty directory with these two example files and a pytest.ini of `parity_dtypes = fp32,bf16`: "
          "pytest --update-baselines test_gpt2.py test_tagger.py; then copy its baselines/ to tests/data/replay_baselines/")


def _project(pytester: pytest.Pytester) -> None:
    pytester.makeini("""
        [pytest]
        parity_dtypes = fp32,bf16
    """)
    for name in FILES:
        (pytester.path / name).write_text(EXAMPLES[name], encoding="utf-8")
    shutil.copytree(COMMITTED, pytester.path / "baselines")


def _judged(result: pytest.RunResult) -> str:
    out = result.stdout.str()
    assert "stale" not in out, out
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["10 checks: 10 pass", "reference: 5 checks vs baseline cpu (AMD EPYC) * recipe bf16"])
    return out


@pytest.mark.skipif(not runs_bf16_lstm(), reason=NO_BF16_LSTM)  # the tagger's LSTM under bf16
def test_the_committed_recordings_compare_green_here(pytester: pytest.Pytester) -> None:
    _project(pytester)
    _judged(pytester.runpytest("--npu-parity", "--parity-reference", "baseline", "-p", "no:randomly"))


@pytest.mark.skipif(not runs_bf16_lstm(), reason=NO_BF16_LSTM)  # the tagger's LSTM under bf16
def test_the_committed_recordings_compare_green_on_another_kernel_path(pytester: pytest.Pytester,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    _project(pytester)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    out = _judged(pytester.runpytest_subprocess("--npu-parity", "--parity-reference", "baseline", "-p", "no:randomly"))
    assert out.count("replayed the recorded weights") >= 6, out  # GPT-2's draws differ on that path
