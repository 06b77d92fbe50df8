"""What the current run is: the provenance record a baseline stores.

A stored baseline is only as trustworthy as what is known about the run that produced it. This
module describes the run in which it is called:

* ``collect_provenance(device, recipe=..., seed=...)`` — a JSON-ready dict: plugin, torch,
  torch_npu, CANN, transformers and (when the run imported Aurora) aurora-model versions, Python
  and OS, torch's intra-op and inter-op thread counts, the device type and name, recipe, seed,
  precision flags, creation time (UTC) and the project's git revision; on an
  NPU also torch_npu's compile mode and the Ascend/HCCL environment (``ascend_environment``).
  The host name is deliberately left out (baselines are committed to git and shared).
* ``device_name(device)`` — the CPU model, or the CUDA/NPU device's name.

It reads the machine (CANN's version through ``runtime.npu``), so it lives in ``runtime``; the store
keeps the record as it is given and prints it (:func:`pytest_npu_parity.store.provenance.describe_provenance`).
The old import path ``pytest_npu_parity.provenance`` re-exports every name.

Nothing here imports ``torch_npu``: on a machine without CANN that import can break ``import
torch`` itself (see docs/explanation/findings.md), so its version is read from package metadata unless the
module is already loaded.
"""
from __future__ import annotations

import datetime as _dt
import functools
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

import torch

__all__ = [
    "collect_provenance",
]

#: (implementer, part) codes from /proc/cpuinfo on Arm hosts -> marketing name. Ascend servers
#: usually run on HiSilicon Kunpeng 920 (implementer 0x48, part 0xd01), whose /proc/cpuinfo has no
#: "model name" line. Source: the Linux kernel's arch/arm64/include/asm/cputype.h.
_ARM_PARTS = {
    ("0x48", "0xd01"): "HiSilicon Kunpeng-920",
    ("0x41", "0xd0c"): "Arm Neoverse-N1",
    ("0x41", "0xd40"): "Arm Neoverse-V1",
    ("0x41", "0xd4f"): "Arm Neoverse-V2",
    ("0x41", "0xd49"): "Arm Neoverse-N2",
}


# --------------------------------------------------------------------------------------------
# provenance record


def collect_provenance(
    device: torch.device | str,
    *,
    recipe: str,
    seed: int | None,
    precision_flags: dict | None = None,
    extra: dict | None = None,
) -> dict:
    """Describe the current run as a JSON-serializable provenance record.

    Args:
        device: the device the recorded outputs were computed on (``cpu``, ``cuda:0``, ``npu:1``).
        recipe: the precision recipe (``fp32``, ``bf16``, ...).
        seed: the seed the check ran under, or ``None``.
        precision_flags: device numerics switches in force (TF32/HF32 and the like), as
            ``name -> bool/str/number``.
        extra: further JSON-serializable fields (input specification, config hash, ...); they are
            merged at the top level and take precedence over the collected keys.

    Returns:
        A dict with the keys ``plugin_version, torch, cuda, torch_npu, cann, transformers,
        aurora_model, python, platform, threads, interop_threads, device_type, device_index,
        device_name, recipe, seed, precision_flags, created, git_revision, git_dirty``; for an NPU
        device also ``npu_compile_mode`` (:func:`npu_compile_mode`) and ``ascend_env``
        (:func:`ascend_environment`). Versions
        of absent packages and an unknown git revision are ``None``; ``aurora_model`` is None unless
        the ``aurora`` package is imported in this process (a project without Aurora does not
        depend on its version). ``threads``/``interop_threads`` are ``torch.get_num_threads()`` /
        ``torch.get_num_interop_threads()``: bf16 CPU kernels block their reductions by thread
        count, so a bf16 CPU baseline depends on it (docs/explanation/verdict-accuracy.md). ``created`` is UTC ISO-8601 to the second
        (``2026-11-30T09:27:05+00:00``). The host name is never included.

    Raises:
        TypeError: when ``precision_flags`` or ``extra`` hold a value JSON cannot encode; the
            message names the key.

    Never raises for missing packages, a missing ``git`` or an unreadable device name.
    """
    device = torch.device(device)
    revision, dirty = _git_state(os.getcwd())
    prov: dict[str, Any] = {
        "plugin_version": _plugin_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "torch_npu": _torch_npu_version(),
        "cann": _cann_version(),
        "transformers": _dist_version("transformers"),
        "aurora_model": _dist_version("aurora-model") if "aurora" in sys.modules else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "device_type": device.type,
        "device_index": device.index,
        "device_name": device_name(device),
        "recipe": recipe,
        "seed": seed,
        "precision_flags": dict(precision_flags or {}),
        "created": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "git_revision": revision,
        "git_dirty": dirty,
    }
    if device.type == "npu":  # only there: on other targets torch_npu's runtime is not touched
        prov["npu_compile_mode"] = npu_compile_mode()
        prov["ascend_env"] = ascend_environment()
    for key, value in (extra or {}).items():
        prov[str(key)] = value
    for key, value in prov.items():
        try:
            json.dumps(value, allow_nan=True)
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"provenance field {key!r} is not JSON-serializable ({type(value).__name__}): {exc}; "
                "pass strings, numbers, booleans, None, or lists/dicts of them"
            ) from None
    return prov


#: Environment variables that change what torch_npu, CANN or HCCL compute or how they behave, recorded
#: by name (``ascend_environment``) besides every ``ASCEND_*`` and ``HCCL_*`` variable. Sources: the seed
#: guides (000 §7.3/§9.2/§9.3: ``HCCL_TIMEOUT``, ``HCCL_BUFFSIZE``, ``PYTORCH_NPU_ALLOC_CONF``; 001 §0.1/§0.5:
#: ``ASCEND_RT_VISIBLE_DEVICES``, ``ASCEND_GLOBAL_LOG_LEVEL``, ``ASCEND_SLOG_PRINT_TO_STDOUT``,
#: ``ASCEND_AICPU_PATH``) and the variables the torch_npu 2.5.1 wheel reads (``torch_npu/lib/libtorch_npu.so``
#: strings and its Python sources): ``INF_NAN_MODE_ENABLE`` / ``INF_NAN_MODE_FORCE_DISABLE`` (inf/NaN vs
#: saturation mode of fp16 overflow, which the GradScaler's overflow check depends on), ``TASK_QUEUE_ENABLE``,
#: ``ASCEND_LAUNCH_BLOCKING``, ``MULTI_STREAM_MEMORY_REUSE``, ``COMBINED_ENABLE``, ``P2P_HCCL_BUFFSIZE``,
#: ``HCCL_DETERMINISTIC``, ``HCCL_ALGO``, ``HCCL_EXEC_TIMEOUT``, ``HCCL_CONNECT_TIMEOUT``, ``NPU_ASD_*``
#: (silent-data-corruption detection), ``ACLNN_CACHE_LIMIT``, ``ENABLE_ACLNN``, ``CPU_AFFINITY_CONF``,
#: ``NPU_FUZZY_COMPILE_BLACKLIST``, ``HOST_CACHE_CAPACITY``.
ASCEND_ENV_NAMES: tuple[str, ...] = (
    "PYTORCH_NPU_ALLOC_CONF", "INF_NAN_MODE_ENABLE", "INF_NAN_MODE_FORCE_DISABLE", "TASK_QUEUE_ENABLE",
    "MULTI_STREAM_MEMORY_REUSE", "COMBINED_ENABLE", "P2P_HCCL_BUFFSIZE", "NPU_ASD_ENABLE",
    "NPU_ASD_SIGMA_THRESH", "NPU_ASD_UPPER_THRESH", "ACLNN_CACHE_LIMIT", "ENABLE_ACLNN", "CPU_AFFINITY_CONF",
    "NPU_FUZZY_COMPILE_BLACKLIST", "HOST_CACHE_CAPACITY",
)
#: Prefixes of the recorded variables (CANN's ``ASCEND_*``, HCCL's ``HCCL_*``).
ASCEND_ENV_PREFIXES: tuple[str, ...] = ("ASCEND_", "HCCL_")
#: Value recorded for a location variable (name ending in ``_PATH`` or ``_HOME``): that it is set
#: counts (e.g. ``ASCEND_CUSTOM_OPP_PATH`` swaps kernels), the directory names a machine, not a
#: setting, and baselines are shared (CANN's version is recorded on its own).
LOCATION_SET = "<set>"


def ascend_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The Ascend/HCCL environment variables of this run that change numerics or behaviour.

    Args:
        environ: the environment to read (default ``os.environ``).

    Returns:
        ``{name: value}`` sorted by name, for every variable named in ``ASCEND_ENV_NAMES`` or starting
        with one of ``ASCEND_ENV_PREFIXES``; a location variable (``*_PATH``, ``*_HOME``) is recorded
        as ``LOCATION_SET``. Empty when none is set.
    """
    environ = os.environ if environ is None else environ
    found = {}
    for name in sorted(environ):
        if name in ASCEND_ENV_NAMES or name.startswith(ASCEND_ENV_PREFIXES):
            found[name] = LOCATION_SET if name.endswith(("_PATH", "_HOME")) else str(environ[name])
    return found


def npu_compile_mode() -> str | None:
    """torch_npu's operator compile mode in force: ``"jit_compile=False"`` (CANN's precompiled binary
    kernels, what the guide's launcher sets, seed §9.4) or ``"jit_compile=True"`` (online compilation,
    torch_npu's default), read with ``torch_npu.npu.is_jit_compile_false()`` (torch_npu 2.5.1
    ``torch_npu/npu/npu_config.py``); None when torch_npu is not loaded or cannot answer. Only
    called for an NPU device (the call initializes the NPU runtime)."""
    module = sys.modules.get("torch_npu")
    getter = getattr(getattr(module, "npu", None), "is_jit_compile_false", None)
    if getter is None:
        return None
    try:
        return f"jit_compile={not bool(getter())}"
    except Exception:  # a broken runtime must not stop a provenance record
        return None


def device_name(device: torch.device | str) -> str:
    """Human-readable name of ``device``: CPU model, ``torch.cuda.get_device_name`` (e.g.
    ``"NVIDIA H200"``) or ``torch.npu.get_device_name`` (e.g. ``"Ascend910B"``).

    Falls back to ``str(device)`` when the name cannot be read; never raises.
    """
    device = torch.device(device)
    try:
        if device.type == "cpu":
            return _cpu_model()
        if device.type == "cuda":
            return str(torch.cuda.get_device_name(device))
        module = getattr(torch, device.type, None)
        getter = getattr(module, "get_device_name", None)
        if getter is not None:
            return str(getter(device.index if device.index is not None else 0))
    except Exception:  # a broken driver must not stop a provenance record
        pass
    return str(device)


@functools.lru_cache(maxsize=4)
def _cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """CPU model from ``cpuinfo`` (x86 "model name", or Arm implementer/part codes), else
    ``platform.processor()``/``platform.machine()``."""
    fields: dict[str, str] = {}
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, sep, value = line.partition(":")
                if sep and key.strip() not in fields:
                    fields[key.strip()] = value.strip()
    except OSError:
        pass
    for key in ("model name", "Model Name", "cpu model"):
        if fields.get(key):
            return " ".join(fields[key].split())
    implementer, part = fields.get("CPU implementer", "").lower(), fields.get("CPU part", "").lower()
    if implementer and part:
        return _ARM_PARTS.get((implementer, part), f"Arm CPU (implementer {implementer}, part {part})")
    if fields.get("Processor"):
        return " ".join(fields["Processor"].split())
    return platform.processor() or platform.machine() or "cpu"


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
    except Exception:
        return None


def _plugin_version() -> str | None:
    version = _dist_version("pytest-npu-parity")
    if version is None:
        package = sys.modules.get("pytest_npu_parity")
        version = getattr(package, "__version__", None)
    return version


def _torch_npu_version() -> str | None:
    module = sys.modules.get("torch_npu")
    version = getattr(module, "__version__", None)
    if version:
        return str(version)
    return _dist_version("torch-npu") or _dist_version("torch_npu")


def _cann_version() -> str | None:
    try:
        from . import npu  # optional engine module; reads CANN's version files without torch_npu
    except ImportError:
        return None
    getter = getattr(npu, "cann_version", None)
    if getter is None:
        return None
    try:
        version = getter()
    except Exception:
        return None
    return None if version is None else str(version)


def _git_state(cwd: str) -> tuple[str | None, bool | None]:
    """(``git rev-parse HEAD``, whether tracked files differ from it) in ``cwd``; never raises."""
    return _git_state_cached(cwd)


@functools.lru_cache(maxsize=8)
def _git_state_cached(cwd: str) -> tuple[str | None, bool | None]:
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10,
                stdin=subprocess.DEVNULL,
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    revision = git("rev-parse", "--verify", "--quiet", "HEAD")
    if not revision:
        return None, None
    status = git("status", "--porcelain", "--untracked-files=no")
    return revision, (None if status is None else bool(status))
