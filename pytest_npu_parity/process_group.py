"""Old import path of the process-group teardown (``destroy_process_groups``). The code lives in
``pytest_npu_parity.runtime.process_group``.

``from pytest_npu_parity.process_group import ...`` (every name this module had, private helpers included) keeps
working. To patch a name the code looks up, patch it in its new home: a name set on this module is not
seen there.
"""
from __future__ import annotations

from typing import Any

from .runtime import process_group as _process_group
from .runtime.process_group import *  # noqa: F401,F403  (re-exported)


def __getattr__(name: str) -> Any:
    """Any other name of the module above (e.g. its private helpers), looked up when asked."""
    return getattr(_process_group, name)
