"""Old import path of the CANN layouts and torch_npu wheel generations. The code lives in
``pytest_npu_parity.runtime.npu.release``.

``from pytest_npu_parity import ascend_release`` (and every name this module had, private helpers
included) keeps working. To patch a name the code looks up, patch it in its new home: a name set on
this module is not seen there.
"""
from __future__ import annotations

from typing import Any

from .runtime.npu import release as _release
from .runtime.npu.release import *  # noqa: F401,F403  (re-exported)
from .runtime.npu.release import _RELEASE, _release_tuple  # noqa: F401  (re-exported)


def __getattr__(name: str) -> Any:
    """Any other name of the module above."""
    return getattr(_release, name)
