"""Old import path of the provenance record and the content fingerprints; the code lives in
``pytest_npu_parity.runtime.machine`` (``collect_provenance``, ``device_name``: where, when and with what
software a baseline was recorded), ``store.provenance`` (``describe_provenance``), ``store.digests`` (``fingerprint_tensors``,
``fingerprint_module``, ``module_tensor_digests``, ``weights_changed``) and ``store.summaries``
(``summarize_tensors``, ``summaries_close``, ``SUMMARY_RTOL``).

``from pytest_npu_parity.provenance import collect_provenance, fingerprint_module`` (and every other name
this module had, private helpers included) keeps working. To patch a name the code looks up
(``PARALLEL_HASH_BYTES``, ``_feed_tensor`` …), patch it in its new home: a name set on this module is not
seen there.
"""
from __future__ import annotations

from typing import Any

from .runtime import machine as _machine
from .store import digests as _digests
from .store import provenance as _provenance
from .store import summaries as _summaries
from .store.digests import (  # noqa: F401  (re-exported)
    DIGEST_SIZE,
    PARALLEL_HASH_BYTES,
    TENSOR_DIGEST_HEX,
    _MODULE_CACHE,
    _TENSOR_CACHE,
    _digest_in_parallel,
    _feed_tensor,
    _hash_tensor,
    _tensor_digest,
    fingerprint_module,
    fingerprint_tensors,
    module_tensor_digests,
    tensor_bytes,
    uninitialized,
    weights_changed,
)
from .runtime.machine import (  # noqa: F401  (re-exported)
    ASCEND_ENV_NAMES,
    ASCEND_ENV_PREFIXES,
    LOCATION_SET,
    _cpu_model,
    _git_state,
    _git_state_cached,
    ascend_environment,
    collect_provenance,
    device_name,
    npu_compile_mode,
)
from .store.provenance import describe_provenance  # noqa: F401  (re-exported)
from .store.summaries import SUMMARY_RTOL, summaries_close, summarize_tensors  # noqa: F401  (re-exported)

__all__ = [
    "collect_provenance",
    "describe_provenance",
    "fingerprint_tensors",
    "fingerprint_module",
]


def __getattr__(name: str) -> Any:
    """Any other name of the modules above (e.g. their private helpers), looked up when asked."""
    for module in (_machine, _provenance, _digests, _summaries):
        try:
            return getattr(module, name)
        except AttributeError:
            pass
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
