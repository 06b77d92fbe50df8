"""Old import path of the shared random stream (``same_randomness``, ``randomness``).
The code lives in ``pytest_npu_parity.runtime.rng``.

``from pytest_npu_parity.rng import ...`` (every name this module had, private helpers included) keeps
working. To patch a name the code looks up, patch it in its new home: a name set on this module is not
seen there.
"""
from __future__ import annotations

from typing import Any

from .runtime import rng as _rng
from .runtime.rng import *  # noqa: F401,F403  (re-exported)


def __getattr__(name: str) -> Any:
    """Any other name of the module above (e.g. its private helpers), looked up when asked."""
    return getattr(_rng, name)
