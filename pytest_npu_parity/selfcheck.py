"""Old import path of the self-check (does a check have teeth?). The code lives in
``pytest_npu_parity.diagnose.selfcheck``.

``from pytest_npu_parity.selfcheck import SelfCheck, scaled_parameter`` (and every other name this
module had, private helpers included) keeps working. To patch a name the code looks up, patch it in
its new home: a name set on this module is not seen there.
"""
from __future__ import annotations

from typing import Any

from .diagnose import selfcheck as _selfcheck
from .diagnose.selfcheck import *  # noqa: F401,F403  (re-exported)


def __getattr__(name: str) -> Any:
    """Any other name of ``diagnose.selfcheck`` (e.g. its private helpers)."""
    try:
        return getattr(_selfcheck, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
