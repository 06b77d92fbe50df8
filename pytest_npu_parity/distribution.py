"""Old import path of the distribution verdict; the code lives in ``pytest_npu_parity.judge.distribution``.

``from pytest_npu_parity.distribution import compare_distributions`` (and every other name of that
module, private helpers included) keeps working. To patch a name the code looks up, patch it in
``pytest_npu_parity.judge.distribution``: a name set on this module is not seen there.
"""
from __future__ import annotations

from typing import Any

from .judge import distribution as _distribution
from .judge.distribution import *  # noqa: F401,F403  (re-exported)


def __getattr__(name: str) -> Any:
    """Any other name of ``pytest_npu_parity.judge.distribution`` (e.g. its private helpers)."""
    try:
        return getattr(_distribution, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
