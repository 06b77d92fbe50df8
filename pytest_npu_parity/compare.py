"""Old import path of the allclose judge; the code lives in ``pytest_npu_parity.judge.allclose``
(with ``judge.msprobe`` for msprobe's dump-compare view and ``pytest_npu_parity.leaves`` for
``flatten`` and the Hugging Face cache readers).

``from pytest_npu_parity.compare import compare, ParityError, flatten`` (and every other name this
module had, private helpers included) keeps working. To patch a name the code looks up (``BLOCK``,
``_per_thread_intra_op`` …), patch it in its new home: a name set on this module is not seen there.
"""
from __future__ import annotations

from typing import Any

from . import leaves as _leaves
from .judge import allclose as _allclose
from .judge import msprobe as _msprobe
from .leaves import *  # noqa: F401,F403  (re-exported)
from .leaves import _leaves_by_path  # noqa: F401  (re-exported)
from .judge.msprobe import *  # noqa: F401,F403  (re-exported)
from .judge.allclose import *  # noqa: F401,F403  (re-exported)
from .judge.allclose import _Accumulator, _per_thread_intra_op  # noqa: F401  (re-exported)


def __getattr__(name: str) -> Any:
    """Any other name of the modules above (e.g. their private helpers), looked up when asked, so a
    module-level value such as ``_PER_THREAD`` is the current one."""
    for module in (_allclose, _msprobe, _leaves):
        try:
            return getattr(module, name)
        except AttributeError:
            pass
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
