"""Old import path of the machine-independent seeded weights (``stable_init_``, ``stable_uniform``).
The code lives in ``pytest_npu_parity.runtime.stable_init``.

``from pytest_npu_parity.stable_init import ...`` (every name this module had, private helpers included) keeps
working. To patch a name the code looks up, patch it in its new home: a name set on this module is not
seen there.
"""
from __future__ import annotations

from typing import Any

from .runtime import stable_init as _stable_init
from .runtime.stable_init import *  # noqa: F401,F403  (re-exported)


def __getattr__(name: str) -> Any:
    """Any other name of the module above (e.g. its private helpers), looked up when asked."""
    return getattr(_stable_init, name)
