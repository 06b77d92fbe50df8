"""pytest-npu-parity: prove that a PyTorch model computes the same thing on its target device.

The public engine API is importable from here without pytest::

    from pytest_npu_parity import compare, Tolerance, ParitySession, ParityCase

Names are imported lazily so that loading the pytest plugin does not import torch for projects that
never run a parity check.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "compare": "judge.allclose",
    "compare_tensors": "judge.allclose",
    "CompareResult": "judge.allclose",
    "ParityError": "judge.allclose",
    "Tolerance": "judge.tolerance",
    "default_for_dtype": "judge.tolerance",
    "default_for_recipe": "judge.tolerance",
    "RECIPES": "runtime.recipes",
    "same_randomness": "runtime.rng",
    "compare_distributions": "judge.distribution",
    "compare_samples": "judge.distribution",
    "DistributionPolicy": "judge.distribution",
    "resolve_target": "runtime.devices",
    "DeviceUnavailableError": "runtime.devices",
    "ParitySession": "runner",
    "ParityCase": "runner",
    "CheckRecord": "runner",
    "fp32_islands": "diagnose.counterfactual.modify",
    "TrajectoryLoop": "runtime.trajectory",
    "TrajectoryPolicy": "judge.trajectory",
    "judge_trajectory": "judge.trajectory",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
