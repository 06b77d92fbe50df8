"""Loading torch and torch_npu safely: ``import_torch``, the quarantine, ``prepare_torch`` and ``npu_status``.

Installing torch_npu on a machine without CANN breaks ``import torch`` (device-backend autoload), and
this module must still be able to say so: torch is imported with autoload off while torch_npu is
suspect, torch_npu explicitly, and a torch_npu that cannot load is marked absent (quarantined) with the
sentence that says why. The process-wide state lives here: the cached status (``_STATUS``, under
``_STATUS_LOCK``), ``_AUTOLOAD_SUPPRESSED`` and the quarantine's reason (``_QUARANTINED``).
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import os
import sys
import threading
from typing import Any

from .cann import _looked_in, _wanted_cann, find_cann, set_env_fix
from .diagnosis import AUTOLOAD_ENV, _diagnose, _first_line, explain_import_error, not_installed_sentence
from .versions import _dist_version, _find_spec, base_version, version_mismatch_sentence


@dataclasses.dataclass(frozen=True)
class NpuStatus:
    """Whether an Ascend NPU is usable in this process.

    Attributes:
        available: torch_npu imported and at least one NPU is visible.
        reason: one sentence with the fix when not available; None when available.
        torch_npu_version: installed torch_npu version (from the module, or its metadata), or None.
        cann_version: CANN version read from the toolkit files, or None.
        device_count: visible NPUs (0 when not available).
        device_name: name of NPU 0 (e.g. ``"Ascend910B3"``), or None.
    """

    available: bool
    reason: str | None
    torch_npu_version: str | None
    cann_version: str | None
    device_count: int
    device_name: str | None


_STATUS: NpuStatus | None = None
_STATUS_LOCK = threading.RLock()
#: True once ``import_torch`` imported torch with device-backend autoload switched off.
_AUTOLOAD_SUPPRESSED = False


def _autoload_enabled() -> bool:
    return os.environ.get(AUTOLOAD_ENV, "1") == "1"


def _torch_npu_autoloads() -> bool:
    """Whether torch_npu registers a ``torch.backends`` entry point (so ``import torch`` loads it)."""
    try:
        return any(ep.name == "torch_npu" or ep.value.split(":")[0].split(".")[0] == "torch_npu"
                   for ep in importlib.metadata.entry_points(group="torch.backends"))
    except Exception:
        return False


def import_torch() -> Any:
    """Import torch without letting an installed-but-broken torch_npu break it.

    When torch is not imported yet and torch_npu is installed, ``import torch`` runs with
    ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` (restored afterwards), so a torch_npu that cannot load
    (no CANN, wrong versions) does not take torch down with it; ``npu_status`` then imports
    torch_npu explicitly and reports why it fails. Other autoloaded device backends are not loaded
    in that case. Without torch_npu installed this is a plain ``import torch``.

    Raises:
        ImportError / RuntimeError: whatever ``import torch`` raises (pass it to
        ``explain_import_error``).
    """
    if "torch" in sys.modules:
        return sys.modules["torch"]
    if _find_spec("torch_npu") is None:
        return importlib.import_module("torch")
    global _AUTOLOAD_SUPPRESSED
    with _STATUS_LOCK:
        saved = os.environ.get(AUTOLOAD_ENV)
        os.environ[AUTOLOAD_ENV] = "0"
        try:
            torch = importlib.import_module("torch")
            _AUTOLOAD_SUPPRESSED = True
            return torch
        finally:
            if saved is None:
                os.environ.pop(AUTOLOAD_ENV, None)
            else:
                os.environ[AUTOLOAD_ENV] = saved


#: Environment variable carrying a quarantine's reason to subprocesses (spawned ranks).
QUARANTINE_ENV = "NPU_PARITY_TORCH_NPU_UNUSABLE"
_QUARANTINED: str | None = None


def quarantine_torch_npu(reason: str) -> None:
    """Mark a torch_npu that cannot be imported in this process as absent.

    The real wheel registers a ``torch.backends`` entry point, so with CANN missing a bare
    ``import torch`` fails ("Failed to load the backend extension: torch_npu"), and every
    ``import torch_npu`` fails again on ``libhccl.so`` — including the one inside Hugging Face
    transformers' ``is_torch_npu_available()`` (transformers/utils/import_utils.py, 4.57: it runs an
    unguarded ``import torch_npu`` whenever ``importlib.util.find_spec("torch_npu")`` finds the
    package), which every transformers model import reaches. After the failure has been diagnosed,
    this sets ``sys.modules["torch_npu"] = None``: ``find_spec`` then returns None (CPython's
    ``importlib.util.find_spec`` for a ``None`` entry), so transformers sees no NPU, and
    ``import torch_npu`` raises ``ImportError`` ("import of torch_npu halted"), which is what the
    usual ``try: import torch_npu / except ImportError`` probes expect (msprobe's
    ``pytorch/common/utils.py``). ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` is left set, as the real
    wheel's ``__init__`` leaves it, so subprocesses can ``import torch`` too, and
    ``NPU_PARITY_TORCH_NPU_UNUSABLE`` carries the reason to them (:func:`prepare_torch` there
    quarantines at once instead of probing again). The reason stays available through
    :func:`quarantined`, ``npu_status().reason``, the report header and the doctor.

    Args:
        reason: the one-sentence cause and fix (``npu_status().reason``).
    """
    global _QUARANTINED
    sys.modules["torch_npu"] = None  # type: ignore[assignment]
    _QUARANTINED = reason
    os.environ[AUTOLOAD_ENV] = "0"
    os.environ[QUARANTINE_ENV] = reason


def quarantined() -> str | None:
    """The reason torch_npu was quarantined in this process (:func:`quarantine_torch_npu`), or None."""
    return _QUARANTINED if "torch_npu" in sys.modules and sys.modules["torch_npu"] is None else None


def prepare_torch() -> str | None:
    """Make ``import torch`` and ``import torch_npu`` safe in this process, as early as possible.

    Called when the pytest plugin is loaded (its ``pytest11`` entry point is imported before any
    conftest) and at the start of every spawned rank. Where torch_npu is not installed it does
    nothing and imports nothing. Otherwise, unless the user set ``TORCH_DEVICE_BACKEND_AUTOLOAD``
    themselves, it does what torch's autoload would do, safely: ``import torch`` with autoload off,
    then ``import torch_npu`` explicitly (``npu_status``). A torch_npu that loads stays loaded,
    exactly as autoload leaves it; one that does not is quarantined
    (:func:`quarantine_torch_npu`: marked absent), so conftests, transformers, aurora and msprobe
    import normally and the run goes on without the NPU.

    Returns:
        None when torch_npu is absent or usable; else the sentence that says why the NPU is not
        used (also in the report header and in ``--parity-device npu``'s usage error).
    """
    reason = quarantined()
    if reason is not None:
        return reason
    if _find_spec("torch_npu") is None or "torch_npu" in sys.modules:
        return None
    inherited = os.environ.get(QUARANTINE_ENV)
    if inherited:
        quarantine_torch_npu(inherited)
        return inherited
    if "torch" not in sys.modules and AUTOLOAD_ENV in os.environ:
        return None  # the user chose how torch loads its backends
    status = npu_status()
    if status.available:
        return None
    if "torch_npu" not in sys.modules:
        quarantine_torch_npu(status.reason or "torch_npu failed to import")
    return status.reason


def _probe_status() -> NpuStatus:
    cann_info = find_cann()
    cann = cann_info.version if cann_info else None
    npu_version = _dist_version("torch_npu")
    torch_version = _dist_version("torch")

    def unavailable(reason: str, version: str | None = npu_version) -> NpuStatus:
        return NpuStatus(False, reason, version, cann, 0, None)

    if quarantined() is not None:
        return unavailable(quarantined())
    if _find_spec("torch_npu") is None:
        return unavailable(not_installed_sentence(torch_version, cann), None)
    torch_was_imported = "torch" in sys.modules
    # torch_npu's own __init__ switches autoload off and leaves it off when it fails: read it first.
    autoload_on = _autoload_enabled()
    if not torch_was_imported and torch_version and npu_version and (
            base_version(torch_version) != base_version(npu_version)):
        # A torch_npu built for another torch can crash the interpreter on import (seed §10.6):
        # judge from the metadata alone.
        return unavailable(version_mismatch_sentence(torch_version, npu_version))
    try:
        torch = import_torch()
    except Exception as exc:
        return unavailable(explain_import_error(exc))
    torch_version = getattr(torch, "__version__", torch_version)
    if npu_version and base_version(torch_version) != base_version(npu_version):
        return unavailable(version_mismatch_sentence(torch_version, npu_version))
    try:
        torch_npu = importlib.import_module("torch_npu")
    except Exception as exc:
        diagnosis = _diagnose(exc)
        if cann is None and diagnosis.kind == "lib_cann":
            diagnosis.detail = f"{diagnosis.lib} not found and no CANN toolkit under {_looked_in()}"
            diagnosis.fix = (f"install the CANN toolkit{_wanted_cann(npu_version)} matching torch_npu "
                             f"and {set_env_fix(torch_npu=npu_version)}")
        if (not torch_was_imported or _AUTOLOAD_SUPPRESSED) and autoload_on and _torch_npu_autoloads():
            # In a fresh interpreter `import torch` itself autoloads torch_npu and fails the same way.
            diagnosis.autoload = diagnosis.autoload or "torch_npu"
        return unavailable(diagnosis.sentence())
    npu_version = str(getattr(torch_npu, "__version__", None) or npu_version or "") or None
    try:
        npu_mod = torch.npu
        count = int(npu_mod.device_count()) if npu_mod.is_available() else 0
    except Exception as exc:
        return unavailable(f"torch_npu {npu_version} is imported but the NPU runtime fails: "
                           f"{_first_line(exc)} — check the driver with `npu-smi info` and "
                           f"{set_env_fix(cann_info, npu_version)}", npu_version)
    if count == 0:
        visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
        return unavailable(
            f"torch_npu {npu_version} is imported but no NPU is visible "
            f"(torch.npu.device_count() == 0) — check the driver with `npu-smi info` and "
            f"ASCEND_RT_VISIBLE_DEVICES ({'unset' if visible is None else repr(visible)})",
            npu_version)
    try:
        name = str(npu_mod.get_device_name(0))
    except Exception:
        name = None
    return NpuStatus(True, None, npu_version, cann, count, name)


def npu_status(*, refresh: bool = False) -> NpuStatus:
    """Detect torch_npu, CANN and visible NPUs; never raises; cached for the process.

    Order: read the CANN version (``find_cann``); if torch_npu is not installed
    (``importlib.util.find_spec``) stop there without importing anything; if torch_npu's metadata
    says it was built for another torch release, stop without importing it (a mismatched build
    can crash the interpreter); import torch via ``import_torch`` (autoload off while torch_npu is
    suspect); import torch_npu; count devices with ``torch.npu.device_count()``.

    Args:
        refresh: probe again instead of returning the cached result (a failed import is not
            retried by Python, so a second probe only helps after fixing ``sys.path``).

    Returns:
        ``NpuStatus``; when not available, ``reason`` is one sentence naming the fix.
    """
    global _STATUS
    with _STATUS_LOCK:
        if _STATUS is None or refresh:
            try:
                _STATUS = _probe_status()
            except Exception as exc:  # defensive: the probe itself must never take the caller down
                _STATUS = NpuStatus(False, f"NPU detection failed: {_first_line(exc)} — run "
                                    "`python -m pytest_npu_parity doctor` for details",
                                    None, None, 0, None)
        return _STATUS
