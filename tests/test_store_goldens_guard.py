"""The measurement behind ``checks.stored_golden.MISMATCH_FACTOR`` (benchmarks/store_goldens_guard.py), on a
few seeds: references of the same computation recorded with another summation order stay within the
factor and get their golden, and references of an fp32 training step whose computation changed by 1e-4 go
beyond it and get none."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pytest_npu_parity.checks.stored_golden import MISMATCH_FACTOR

# The measurement is a benchmark of the repository (benchmarks/store_goldens_guard.py), not part of the package.
BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
import store_goldens_guard as B  # noqa: E402


@pytest.mark.parametrize("model, recipe", [("projection check", "bf16"), ("MLP step", "fp32"), ("MLP step", "bf16"),
                                           ("BatchNorm step", "bf16"), ("attention step", "bf16")])
def test_a_reference_of_the_same_computation_stays_within_the_factor(tmp_path, model, recipe):
    runs = [B.multiple(B.MODELS[model], recipe, 0.0, seed, tmp_path / str(seed)) for seed in range(2)]
    assert all(0 < value <= MISMATCH_FACTOR and not refused for value, refused in runs), runs


@pytest.mark.parametrize("model", ["MLP step", "BatchNorm step", "attention step"])
def test_an_fp32_step_changed_by_1e_4_goes_beyond_the_factor(tmp_path, model):
    runs = [B.multiple(B.MODELS[model], "fp32", 1e-4, seed, tmp_path / str(seed)) for seed in range(2)]
    assert all(value > MISMATCH_FACTOR and refused for value, refused in runs), runs
