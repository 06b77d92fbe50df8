"""Old import path of the op-level diagnosis. The code lives in ``pytest_npu_parity.diagnose.op_trace``.

``from pytest_npu_parity.op_trace import trace_ops`` (and every other name this module had, private
helpers included) keeps working. To patch a name the code looks up (``trace_ops``,
``ModuleTracker``...), patch it in its new home: a name set on this module is not seen there.
"""
from __future__ import annotations

from typing import Any

from .diagnose import op_trace as _op_trace
from .diagnose.op_trace import *  # noqa: F401,F403  (re-exported)


def __getattr__(name: str) -> Any:
    """Any other name of ``diagnose.op_trace`` (e.g. its private helpers)."""
    try:
        return getattr(_op_trace, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
