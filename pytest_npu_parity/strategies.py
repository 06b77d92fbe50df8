"""Old import path of the Aurora shape strategies and the hypothesis profiles (re-exports only).

The code lives in two places now: the Aurora shape strategies (``AuroraShapes``, ``aurora_shapes``,
``training_shapes``, …) in the Aurora adapter, :mod:`pytest_npu_parity.aurora.strategies`; the
project's hypothesis profiles (``register_profiles``, ``profile_to_load``, ``examples_for``, …) in the
engine, :mod:`pytest_npu_parity.hypothesis_profiles`. Import from there; the engine itself never
imports this module (it would load the Aurora adapter).
"""
from __future__ import annotations

from pytest_npu_parity.aurora.strategies import *  # noqa: F403
from pytest_npu_parity.aurora.strategies import (  # noqa: F401 - private names tests and old callers used
    MAX_HORIZON, MAX_INFERENCE_TOKEN_LEN, MIN_INFERENCE_TOKEN_LEN, TEXT_MAX_LENGTH,
)
from pytest_npu_parity.aurora.strategies import __all__ as _SHAPES
from pytest_npu_parity.hypothesis_profiles import *  # noqa: F403
from pytest_npu_parity.hypothesis_profiles import __all__ as _PROFILES

__all__ = [*_SHAPES, *_PROFILES]
