"""Old import path of the device-propagation audit. The code lives in
``pytest_npu_parity.runtime.audit``: ``events`` (the kinds, ``AuditEvent``, ``AuditRecord``),
``budget`` (``AuditBudget``, ``parse_audit_budget``), ``source`` (``caller_source``), ``state``
(``not_audited``), ``devices``, ``tracker`` (the tracker and its modes) and ``run``
(``DeviceAudit``, ``audit_call``).

``from pytest_npu_parity.audit import DeviceAudit, not_audited`` (and every other name this module
had, private helpers included) keeps working; ``_QUIET`` and ``_LOGICAL`` are the very objects of
``runtime.audit.state``. To patch a name the code looks up, patch it in its new home: a name set
on this module is not seen there.
"""
from __future__ import annotations

from typing import Any

from .runtime import audit as _audit
from .runtime.audit import *  # noqa: F401,F403  (re-exported)
from .runtime.audit import budget as _budget
from .runtime.audit import devices as _devices
from .runtime.audit import events as _events
from .runtime.audit import run as _run
from .runtime.audit import source as _source
from .runtime.audit import state as _state
from .runtime.audit import tracker as _tracker


def __getattr__(name: str) -> Any:
    """Any other name of ``runtime.audit`` or its modules (e.g. their private helpers)."""
    for module in (_audit, _state, _events, _budget, _source, _devices, _tracker, _run):
        try:
            return getattr(module, name)
        except AttributeError:
            pass
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
