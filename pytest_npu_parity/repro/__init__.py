"""Old import path of the standalone reproduction of a red check. The code lives in
``pytest_npu_parity.diagnose.repro`` (``culprit``, ``capture``, ``writer``, ``script``).

``from pytest_npu_parity.repro import ReproWriter`` (and every other name this package had, private
helpers included) keeps working, and so do its submodules' old paths
(``pytest_npu_parity.repro.writer`` is ``pytest_npu_parity.diagnose.repro.writer``). To patch a
name the code looks up, patch it in its new home: a name set on this package is not seen there.
"""
from __future__ import annotations

import sys
from typing import Any

from ..diagnose import repro as _repro
from ..diagnose.repro import *  # noqa: F401,F403  (re-exported)
from ..diagnose.repro import _script_namespace  # noqa: F401  (re-exported)
from ..diagnose.repro import capture, culprit, script, writer

for _module in (capture, culprit, script, writer):  # the old submodule paths name the same modules
    sys.modules.setdefault(f"{__name__}.{_module.__name__.rsplit('.', 1)[1]}", _module)


def __getattr__(name: str) -> Any:
    """Any other name of ``diagnose.repro`` or its modules (e.g. their private helpers)."""
    for module in (_repro, writer, capture, culprit, script):
        try:
            return getattr(module, name)
        except AttributeError:
            pass
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
