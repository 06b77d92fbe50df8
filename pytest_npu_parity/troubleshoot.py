"""Old import path of the guides' troubleshooting items. The code lives in
``pytest_npu_parity.runtime.npu.troubleshoot`` (read by the import diagnosis of ``runtime.npu`` and
by the doctor).

``from pytest_npu_parity.troubleshoot import explain_error`` (and every other name this module had,
private helpers included) keeps working. To patch a name the code looks up (``_dist_version`` …),
patch it in its new home: a name set on this module is not seen there.
"""
from __future__ import annotations

from typing import Any

from .runtime.npu import troubleshoot as _troubleshoot
from .runtime.npu.troubleshoot import *  # noqa: F401,F403  (re-exported)


def __getattr__(name: str) -> Any:
    """Any other name of ``runtime.npu.troubleshoot`` (e.g. its private helpers)."""
    try:
        return getattr(_troubleshoot, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
