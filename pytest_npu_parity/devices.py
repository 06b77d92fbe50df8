"""Old import path of target devices (``resolve_target``, ``DeviceUnavailableError``, the xdist worker's pinned device). The code lives in
``pytest_npu_parity.runtime.devices``.

``from pytest_npu_parity.devices import ...`` (every name this module had, private helpers included) keeps
working. To patch a name the code looks up, patch it in its new home: a name set on this module is not
seen there.
"""
from __future__ import annotations

from typing import Any

from .runtime import devices as _devices
from .runtime.devices import *  # noqa: F401,F403  (re-exported)


def __getattr__(name: str) -> Any:
    """Any other name of the module above (e.g. its private helpers), looked up when asked."""
    return getattr(_devices, name)
