"""Old import path of the compact training-step baselines; the code lives in
``pytest_npu_parity.store.compact``.

``from pytest_npu_parity.compact import parse_train_store`` (and every other name of that module,
private helpers included) keeps working. To patch a name the code looks up, patch it in
``pytest_npu_parity.store.compact``: a name set on this module is not seen there.
"""
from __future__ import annotations

from typing import Any

from .store import compact as _compact
from .store.compact import *  # noqa: F401,F403  (re-exported)
from .store.compact import _compact_one  # noqa: F401  (re-exported)


def __getattr__(name: str) -> Any:
    """Any other name of ``pytest_npu_parity.store.compact`` (e.g. its private helpers)."""
    try:
        return getattr(_compact, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
