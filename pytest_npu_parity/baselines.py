"""Old import path of the baseline store; the code lives in ``pytest_npu_parity.store``, one module per
question: ``store.baselines`` (``BaselineStore``, one suite's files; the layout and the file format are
described there), ``store.suites`` (``SuiteStores``, every suite under one root), ``store.pool`` (the
object pool), ``store.reading`` (reading and verifying one file), ``store.encoding`` (checks to tensors,
records and the checksum), ``store.staleness`` (what makes a stored check stale), ``store.files`` (file
kinds, atomic writes, walking a store), ``store.cli`` (``python -m pytest_npu_parity baselines``), with
``store.format`` (the format's constants, errors and records) and ``store.lock``.

``from pytest_npu_parity.baselines import SuiteStores, CheckBaseline, _read`` (and every other name this
module had, private helpers included) keeps working. To patch a name the code looks up (``os`` for the
atomic write, ``FORMAT_VERSION`` …), patch it in its new home: a name set on this module is not seen there.
"""
from __future__ import annotations

from typing import Any

from .store import baselines as _baselines
from .store import cli as _cli
from .store import encoding as _encoding
from .store import files as _files
from .store import format as _format
from .store import pool as _pool
from .store import reading as _reading
from .store import staleness as _staleness
from .store import suites as _suites
from .store.baselines import BaselineStore  # noqa: F401  (re-exported)
from .store.cli import _cli_parser, main  # noqa: F401  (re-exported)
from .store.files import _atomic_write, _kind, _sniff  # noqa: F401  (re-exported)
from .store.format import (  # noqa: F401  (re-exported: the format's names live in store.format)
    FORMAT,
    FORMAT_VERSION,
    POOL_VERSION,
    OLDEST_READABLE,
    SUFFIX,
    UNSAFE_SUFFIXES,
    MAX_COMPONENT,
    UPDATE_COMMAND,
    OBJECTS_DIR,
    OBJECT_FORMAT,
    POOLED_KINDS,
    POOL_MIN_BYTES,
    OBJECT_REF,
    LOCK_NAME,
    ROOTDIR_SUITE,
    CLASS_SEPARATOR,
    _TEMP_NAME,
    _OBJECT_REF_RE,
    _OBJECT_NAME,
    _DIR_UNSAFE,
    _NAME_UNSAFE,
    _HEADER_LIMIT,
    BaselineError,
    MissingBaselineError,
    StaleBaselineError,
    CorruptBaselineError,
    UnsafeBaselineError,
    StoreLockedError,
    CheckBaseline,
    Baseline,
    _show,
)
from .store.lock import StoreLock  # noqa: F401  (re-exported)
from .store.pool import ObjectPool, PoolObjectError, object_digest  # noqa: F401  (re-exported)
from .store.reading import _read  # noqa: F401  (re-exported)
from .store.suites import SuiteStores  # noqa: F401  (re-exported)

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "SUFFIX",
    "UNSAFE_SUFFIXES",
    "BaselineError",
    "MissingBaselineError",
    "StaleBaselineError",
    "CorruptBaselineError",
    "UnsafeBaselineError",
    "CheckBaseline",
    "Baseline",
    "BaselineStore",
    "SuiteStores",
    "StoreLock",
    "StoreLockedError",
    "LOCK_NAME",
    "ObjectPool",
    "PoolObjectError",
    "object_digest",
    "OBJECTS_DIR",
    "POOLED_KINDS",
    "POOL_MIN_BYTES",
    "POOL_VERSION",
]


def __getattr__(name: str) -> Any:
    """Any other name of the modules above (e.g. their private helpers), looked up when asked."""
    for module in (_baselines, _suites, _pool, _reading, _encoding, _staleness, _files, _cli, _format):
        try:
            return getattr(module, name)
        except AttributeError:
            pass
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
