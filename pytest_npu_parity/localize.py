"""Old import path of first-divergence localization. The code lives in
``pytest_npu_parity.diagnose.localize``: ``record`` (``Site``, ``Localization``, the tables),
``sides`` (the recorder and a side's runs), ``descent`` (the levels, ``localize``), ``cache``
(``LocalizationCache``) and ``hook`` (``Localizer``).

``from pytest_npu_parity.localize import Localizer, localize`` (and every other name this module
had, private helpers included) keeps working. To patch a name the code looks up (``COST_FACTOR``,
``MAX_LEVELS``...), patch it in its new home: a name set on this module is not seen there.
"""
from __future__ import annotations

from typing import Any

from .diagnose.localize import *  # noqa: F401,F403  (re-exported)
from .diagnose.localize import (  # noqa: F401  (re-exported: the private names this module had)
    _Answer, _buffer_table, _Call, _conclude, _conversion_notes, _cpu_copy, _detached_cpu, _fmt, _gradient_table,
    _gradients, _join, _judge_level, _Level, _LevelView, _mode_state, _num, _owner, _patch_key, _plain, _rebuild,
    _Recorder, _relative, _rng_state, _same, _scope_key, _set_rng_state, _Side, _site_table, _snapshot, _State,
    _state, _to_device, _trace_culprit, _View, _worst,
)
from .diagnose.localize import cache as _cache
from .diagnose.localize import descent as _descent
from .diagnose.localize import hook as _hook
from .diagnose.localize import record as _record
from .diagnose.localize import sides as _sides


def __getattr__(name: str) -> Any:
    """Any other name of the modules above."""
    for module in (_record, _sides, _descent, _cache, _hook):
        try:
            return getattr(module, name)
        except AttributeError:
            pass
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
