"""pytest glue for pytest-npu-parity (the ``pytest11`` entry point ``pytest_npu_parity.plugin``).

pytest collects hooks and fixtures from this module object, so every one is imported here:
``options`` (the one table of options and ini keys), ``config`` (``ParityConfig``: every value parsed
once), ``hooks``, ``fixtures``, ``markers``, ``header``, ``summary`` (the terminal summary), ``paths``
(path checks and re-run commands), ``state`` (the ``config.stash`` keys), ``xdist``.
Everything that judges numbers lives in the engine (``runner``, ``checks``, ``compare``, ``policy``,
``baselines`` …); this package only adapts it to pytest.
"""
from __future__ import annotations

from ..runtime import npu as _npu

# The pytest11 entry point is imported before any conftest: with torch_npu installed but unusable
# (no CANN), `import torch` itself would fail there (device-backend autoload). Import torch and
# torch_npu safely now, before the submodules below; the reason the NPU is not used, if any, goes
# into the report header.
try:
    NPU_UNUSED_REASON = _npu.prepare_torch()
except Exception as _exc:  # noqa: BLE001 - never fail pytest's start-up over the NPU probe
    NPU_UNUSED_REASON = f"NPU detection failed: {type(_exc).__name__}: {_exc}"

from .fixtures import (parity, parity_audit_budget, parity_patches, parity_recipe,  # noqa: E402
                       parity_reference_patches, parity_session)
from .hooks import (parity_enabled, pytest_addoption, pytest_collection_finish,  # noqa: E402
                    pytest_collection_modifyitems, pytest_configure, pytest_generate_tests, pytest_report_header,
                    pytest_runtest_makereport, pytest_sessionfinish, pytest_sessionstart, pytest_terminal_summary,
                    pytest_testnodedown, pytest_unconfigure)
from .options import MARKER_KEYS, MAX_SEED, OVERRIDABLE_RECIPES  # noqa: E402
from .paths import LOCALIZE_OPTIONS, PATH_OPTIONS, RECORD_OPTIONS, localize_command, rerun_command  # noqa: E402
from .state import (COLLECTED_KEY, CONFIG_KEY, DEEPSPEED_LINT_KEY, LOCK_KEY,  # noqa: E402
                    OUTCOME_KEY, PROFILE_KEY, ROWS_KEY, SESSION_KEY, STALE_KEY, TEMP_KEY)

__all__ = [
    "NPU_UNUSED_REASON", "parity", "parity_audit_budget", "parity_patches", "parity_recipe",
    "parity_reference_patches", "parity_session",
    "parity_enabled", "pytest_addoption", "pytest_collection_finish", "pytest_collection_modifyitems",
    "pytest_configure",
    "pytest_generate_tests", "pytest_report_header", "pytest_runtest_makereport", "pytest_sessionfinish",
    "pytest_sessionstart", "pytest_terminal_summary", "pytest_testnodedown", "pytest_unconfigure",
    "MARKER_KEYS", "MAX_SEED", "OVERRIDABLE_RECIPES", "LOCALIZE_OPTIONS", "PATH_OPTIONS", "RECORD_OPTIONS",
    "localize_command", "rerun_command", "COLLECTED_KEY", "CONFIG_KEY", "DEEPSPEED_LINT_KEY",
    "LOCK_KEY", "OUTCOME_KEY", "PROFILE_KEY", "ROWS_KEY", "SESSION_KEY", "STALE_KEY", "TEMP_KEY",
]
