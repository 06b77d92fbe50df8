"""The guides' troubleshooting items, recognised in this environment, each with its own cause and fix.

Each function answers one item and returns one sentence (or None when the item does not apply);
the doctor reports them (``environment._guide_troubleshooting`` and ``devices._mem_get_info_fallback``).
Sources: the Aurora→Ascend adaptation guide (seed ``000_76a3155d974abf2f``) and the CUDA→NPU migration
checklist "Npu Basic Migrate" (seed ``001_bdc28f56ad08a5c4``).

Nothing here imports torch, torch_npu or aurora: everything is read from distribution metadata and
files, so a broken install can still be described.
"""
from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

#: torch_npu's runtime dependencies that its wheel does not declare (the 2.14.0 wheel's METADATA
#: requires only torch, numpy and pyyaml): checklist §0.3 "torch_npu 运行常见依赖", the second thing to
#: check when ``import torch_npu`` fails (§0.2).
TORCH_NPU_RUNTIME_DEPS = ("decorator", "attrs", "psutil", "absl-py", "cloudpickle", "ml-dtypes",
                          "scipy", "tornado")

ROPE_IMPORT_ERROR = "cannot import name 'RoPE_decoder' from 'aurora.util_functions'"
_ROPE_FIX = ("the file was overwritten by the patch module (adaptation guide §10.4) — restore upstream's "
             "file (`pip install --force-reinstall --no-deps aurora-model==0.2.0`) and patch at run time "
             "(`pytest_npu_parity.aurora.patches.patched`, which the parity suite applies itself)")


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except Exception:  # PackageNotFoundError, or a broken dist-info
        return None


def _aurora_util_functions() -> list[Path]:
    """Where aurora-model installed ``aurora/util_functions.py`` (its distribution's files), found
    without importing aurora and without asking the import system (whose hooks may count that as an
    import of aurora)."""
    try:
        dist = importlib.metadata.distribution("aurora-model")
    except Exception:  # PackageNotFoundError, or a broken dist-info
        return []
    files = [f for f in (dist.files or []) if str(f).replace("\\", "/") == "aurora/util_functions.py"]
    if not files:  # an editable install lists no package files: look beside its metadata
        return [Path(str(dist.locate_file("aurora/util_functions.py")))]
    return [Path(str(dist.locate_file(f))) for f in files]


def rope_decoder_overwritten(util_functions: Path | None = None) -> str | None:
    """Guide §10.4: the installed ``aurora/util_functions.py`` has no ``RoPE_decoder``.

    Args:
        util_functions: the file to read; default: the one aurora-model installed (read, never
            imported: ``import aurora`` is what fails).

    Returns:
        The sentence, or None when aurora is not installed or the file defines ``RoPE_decoder``.
    """
    for path in ([util_functions] if util_functions is not None else _aurora_util_functions()):
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        if not re.search(r"^def RoPE_decoder\b|^RoPE_decoder\s*=", text, re.MULTILINE):
            return (f"{path} has no RoPE_decoder, so `import aurora` fails with \"ImportError: "
                    f"{ROPE_IMPORT_ERROR}\": {_ROPE_FIX}")
        return None
    return None


def explain_error(exc: BaseException) -> str | None:
    """The sentence for an exception that is one of the guides' items (guide §10.4, checklist §0.3's numpy
    pin), or None."""
    if ROPE_IMPORT_ERROR in str(exc):
        return f"ImportError: {ROPE_IMPORT_ERROR}: {_ROPE_FIX}"
    text = str(exc)
    if any(message in text for message in NUMPY_ABI_MESSAGES):
        return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}: {NUMPY_FIX}"
    return None


def missing_torch_npu_deps() -> str | None:
    """Checklist §0.2–0.3: torch_npu is installed but some of its runtime dependencies are not."""
    if _dist_version("torch_npu") is None and _dist_version("torch-npu") is None:
        return None
    missing = [name for name in TORCH_NPU_RUNTIME_DEPS if _dist_version(name) is None]
    if not missing:
        return None
    return (f"torch_npu's runtime dependencies {', '.join(missing)} are not installed (its wheel does not "
            f"declare them; migration checklist §0.3) — pip install {' '.join(missing)}")


def _requires(name: str) -> list[str]:
    try:
        return list(importlib.metadata.requires(name) or [])
    except Exception:
        return []


_PIN = re.compile(r"^torch\s*\(?\s*==\s*([0-9][^\s,;)]*)")


def torchvision_mismatch() -> str | None:
    """torchvision built for another torch release than the installed one (its own ``Requires-Dist:
    torch (==X)`` pin, e.g. torchvision 0.29.0 → torch 2.14.0, 0.20.1 → 2.5.1)."""
    vision, torch = _dist_version("torchvision"), _dist_version("torch")
    if not vision or not torch:
        return None
    requires = _requires("torchvision")
    pins = [m.group(1) for m in (_PIN.match(r.strip()) for r in requires) if m]
    if not pins:
        return None
    want = pins[0].rstrip(".*")
    if torch.split("+", 1)[0] == want.split("+", 1)[0]:
        return None
    return (f"torchvision {vision} is built for torch {want}, but torch {torch} is installed — install "
            f"the torchvision release built for torch {torch.split('+', 1)[0]} (or torch {want}), in the "
            f"same `pip install` as torch so the two stay paired")


def mem_get_info_fallback(device: str, error: str) -> str:
    """Checklist §3.4: ``torch.npu.mem_get_info`` raised on ``device``; the sentence names the fallback.

    Args:
        device: e.g. ``"npu:0"``.
        error: the first line of the exception.
    """
    index = device.rsplit(":", 1)[-1] if ":" in device else "0"
    return (f"torch.npu.mem_get_info is unavailable on {device} ({error}) — use the migration checklist's "
            f"§3.4 fallback: total = torch.npu.get_device_properties({index}).total_memory, free = total - "
            f"torch.npu.memory_allocated({index}) (or read HBM from `npu-smi info`)")


#: The numpy release the migration checklist pins (§0.3: "numpy 使用 1.26.4（规避 numpy 2.x 与低版本 CANN
#: 兼容问题）" — numpy 1.26.4, to avoid numpy 2.x incompatibilities with older CANN releases).
CHECKLIST_NUMPY = "1.26.4"
#: What numpy 2 prints when a module built against numpy 1.x is imported under it (numpy 2.0's
#: ``_multiarray_umath`` import guard and the C-API table lookup of older extensions).
NUMPY_ABI_MESSAGES = ("A module that was compiled using NumPy 1.x cannot be run in", "_ARRAY_API not found",
                      "numpy.core.multiarray failed to import")
NUMPY_FIX = (f"the migration checklist (§0.3) pins numpy {CHECKLIST_NUMPY} for older CANN releases — "
             f"pip install numpy=={CHECKLIST_NUMPY}")


def numpy_for_old_cann() -> str | None:
    """Checklist §0.3: numpy 2.x beside torch_npu, where the checklist installs numpy 1.26.4.

    Returns:
        A sentence when torch_npu and numpy ≥ 2 are installed, else None. The checklist does not say which
        CANN releases are "older", so this is advice to try when CANN or torch_npu code fails with a numpy
        error (``NUMPY_ABI_MESSAGES``), not a failure by itself.
    """
    if _dist_version("torch_npu") is None and _dist_version("torch-npu") is None:
        return None
    version = _dist_version("numpy")
    if not version or not version.split(".", 1)[0].isdigit() or int(version.split(".", 1)[0]) < 2:
        return None
    return (f"numpy {version} is installed beside torch_npu: if `import torch_npu` or a CANN operator fails with a "
            f"numpy error (\"{NUMPY_ABI_MESSAGES[0]} NumPy 2\", \"{NUMPY_ABI_MESSAGES[1]}\"), {NUMPY_FIX}")


#: HCCL's documented timeouts (CANN environment variable reference: ``HCCL_CONNECT_TIMEOUT``, default
#: 120 s, range [120, 7200], link set-up; ``HCCL_EXEC_TIMEOUT``, default 1800 s, one collective's
#: execution, rounded down to a multiple of 68 s on Atlas training products) and torch_npu's
#: ``HCCL_EVENT_TIMEOUT`` (its environment variable reference: must exceed ``HCCL_EXEC_TIMEOUT``).
HCCL_TIMEOUT_VARIABLES = ("HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT", "HCCL_EVENT_TIMEOUT")


def hccl_timeout_set(environ: dict | None = None) -> str | None:
    """The adaptation guide's launcher exports ``HCCL_TIMEOUT=1800`` (§7.3); neither CANN's environment
    variable reference nor torch_npu's lists that name, so it changes no timeout that those documents
    describe.

    Args:
        environ: the environment to read (default ``os.environ``).

    Returns:
        A sentence when ``HCCL_TIMEOUT`` is set and none of :data:`HCCL_TIMEOUT_VARIABLES` is, else None.
    """
    import os

    env = os.environ if environ is None else environ
    if "HCCL_TIMEOUT" not in env or any(name in env for name in HCCL_TIMEOUT_VARIABLES):
        return None
    return (f"HCCL_TIMEOUT={env['HCCL_TIMEOUT']} is set (the adaptation guide's launcher exports it), but CANN's "
            "and torch_npu's environment variable references document no such variable — set "
            "HCCL_CONNECT_TIMEOUT (link set-up, default 120 s) and HCCL_EXEC_TIMEOUT (one collective, default "
            "1800 s) instead, and HCCL_EVENT_TIMEOUT above HCCL_EXEC_TIMEOUT if you set it")


def environment_findings() -> list[str]:
    """Every item above that applies to this environment (not ``mem_get_info``, which needs a device)."""
    checks = (rope_decoder_overwritten, missing_torch_npu_deps, torchvision_mismatch, numpy_for_old_cann,
              hccl_timeout_set)
    return [sentence for sentence in (check() for check in checks) if sentence]
