"""Old import path of the layer check. The code lives in ``pytest_npu_parity.judge.layers`` (the
verdict: ``LayerPolicy``, ``judge_layers``) and ``pytest_npu_parity.runtime.layer_capture`` (the
records: ``capture_layers``, ``split_layers``, the ``layer:`` key format).

``from pytest_npu_parity.layers import capture_layers, judge_layers`` (and every other name this
module had, private helpers included) keeps working. To patch a name the code looks up, patch it in
its new home: a name set on this module is not seen there.
"""
from __future__ import annotations

from typing import Any

from .judge import layers as _layers
from .runtime import layer_capture as _layer_capture
from .judge.layers import *  # noqa: F401,F403  (re-exported)
from .runtime.layer_capture import *  # noqa: F401,F403  (re-exported)
from .runtime.layer_capture import _SUFFIXES, _sampled  # noqa: F401  (re-exported)


def __getattr__(name: str) -> Any:
    """Any other name of the modules above (e.g. their private helpers)."""
    for module in (_layers, _layer_capture):
        try:
            return getattr(module, name)
        except AttributeError:
            pass
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
