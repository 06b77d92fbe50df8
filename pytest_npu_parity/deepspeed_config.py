"""Old import path of the DeepSpeed config lint (``lint_file``, ``load_config``). The code lives in
``pytest_npu_parity.runtime.deepspeed_config``.

``from pytest_npu_parity.deepspeed_config import ...`` (every name this module had, private helpers included) keeps
working. To patch a name the code looks up, patch it in its new home: a name set on this module is not
seen there.
"""
from __future__ import annotations

from typing import Any

from .runtime import deepspeed_config as _deepspeed_config
from .runtime.deepspeed_config import *  # noqa: F401,F403  (re-exported)


def __getattr__(name: str) -> Any:
    """Any other name of the module above (e.g. its private helpers), looked up when asked."""
    return getattr(_deepspeed_config, name)
