"""Old import path of the golden verdict and the golden run. The code lives in
``pytest_npu_parity.judge.golden`` (the judge), ``judge.golden_policy`` (its limits and specs),
``judge.golden_metrics`` (one side's metrics), ``judge.msprobe`` (msprobe's benchmark arithmetic)
and ``pytest_npu_parity.runtime.golden_run`` (``GoldenRunner``, which runs the golden).

``from pytest_npu_parity.golden import GoldenRunner, judge_golden`` (and every other name this
module had, private helpers included) keeps working. To patch a name the code looks up, patch it in
its new home: a name set on this module is not seen there.
"""
from __future__ import annotations

from typing import Any

from .judge import golden as _golden
from .judge import golden_metrics as _golden_metrics
from .judge import golden_policy as _golden_policy
from .judge import msprobe as _msprobe
from .runtime import golden_run as _golden_run
from .judge.golden import *  # noqa: F401,F403  (re-exported)
from .judge.golden_metrics import *  # noqa: F401,F403  (re-exported)
from .judge.golden_metrics import _SideSums  # noqa: F401  (re-exported)
from .judge.golden_policy import *  # noqa: F401,F403  (re-exported)
from .judge.msprobe import (  # noqa: F401  (re-exported: the benchmark standard's names golden.py had)
    MSPROBE_BF16_EPS, MSPROBE_L1_OPS, MSPROBE_L2_OPS, MSPROBE_LEVEL_LIMITS, MSPROBE_MIN_ERR, MSPROBE_SMALL_LIMIT,
    MSPROBE_SMALL_VALUE, MSPROBE_SMALL_VALUE_ATOL, _MsprobeSums, _round_like_numpy, msprobe_level, msprobe_ratio,
)
from .runtime.golden_run import *  # noqa: F401,F403  (re-exported)


def __getattr__(name: str) -> Any:
    """Any other name of the modules above (e.g. their private helpers)."""
    for module in (_golden, _golden_policy, _golden_metrics, _golden_run, _msprobe):
        try:
            return getattr(module, name)
        except AttributeError:
            pass
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
