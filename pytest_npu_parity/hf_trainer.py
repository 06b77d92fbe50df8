"""Old import path of the Hugging Face ``Trainer`` loop (``TrainerLoop``).
The code lives in ``pytest_npu_parity.runtime.hf_trainer``.

``from pytest_npu_parity.hf_trainer import ...`` (every name this module had, private helpers included) keeps
working. To patch a name the code looks up, patch it in its new home: a name set on this module is not
seen there.
"""
from __future__ import annotations

from typing import Any

from .runtime import hf_trainer as _hf_trainer
from .runtime.hf_trainer import *  # noqa: F401,F403  (re-exported)


def __getattr__(name: str) -> Any:
    """Any other name of the module above (e.g. its private helpers), looked up when asked."""
    return getattr(_hf_trainer, name)
