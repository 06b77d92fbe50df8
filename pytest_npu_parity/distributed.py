"""Old import path of data-parallel parity (``data_parallel_step``, ``reference_step``). The code lives in
``pytest_npu_parity.runtime.distributed``.

``from pytest_npu_parity.distributed import ...`` (every name this module had, private helpers included) keeps
working. To patch a name the code looks up, patch it in its new home: a name set on this module is not
seen there.
"""
from __future__ import annotations

from typing import Any

from .runtime import distributed as _distributed
from .runtime.distributed import *  # noqa: F401,F403  (re-exported)


def __getattr__(name: str) -> Any:
    """Any other name of the module above (e.g. its private helpers), looked up when asked."""
    return getattr(_distributed, name)
