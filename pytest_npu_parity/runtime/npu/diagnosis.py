"""What a failed ``import torch`` / ``import torch_npu`` means, in one sentence that names the fix.

``explain_import_error`` reads an exception and its cause chain (a CANN library not found, two
accelerators, an ABI mismatch, the guides' own items); ``not_installed_sentence`` says which wheel to
install. The sentences are those of the plugin's ``--parity-device npu`` error and of the doctor.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import re

from . import troubleshoot
from .cann import set_env_fix
from .versions import SEED_ROW, _suggest, base_version, cann_release, documented_rows

AUTOLOAD_ENV = "TORCH_DEVICE_BACKEND_AUTOLOAD"


_SHARED_LIB = re.compile(r"(lib[\w.+-]*?\.so(?:\.[\d.]+)?)\s*:\s*cannot open shared object file")
#: Shared libraries that live in the CANN toolkit / driver (a missing one means CANN is not sourced).
_CANN_LIBS = ("libhccl", "libascendcl", "libge_runner", "libgraph", "libruntime", "libascend_hal",
              "libacl_", "libmsprofiler", "libregister", "liberror_manager", "libopapi", "libhccl_")


def _exception_chain(exc: BaseException) -> list[BaseException]:
    chain, seen = [], set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(chain) < 16:
        chain.append(current)
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return chain


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


@dataclasses.dataclass
class _Diagnosis:
    """What went wrong (``detail``), how to fix it, and which autoloaded extension failed, if any."""

    kind: str  # lib_cann | lib_other | two_accelerators | abi | guide | other
    detail: str
    fix: str
    autoload: str | None = None
    lib: str | None = None

    def sentence(self) -> str:
        if self.kind == "two_accelerators":  # the message already says what to do about autoload
            return f"{self.detail} — {self.fix}"
        if self.autoload:
            return (f"Failed to load the backend extension: {self.autoload} ({self.detail}) — "
                    f"{self.fix}, or set {AUTOLOAD_ENV}=0 to use torch without the NPU")
        return f"torch_npu is not importable: {self.detail} — {self.fix}"


_MATRIX_FIX = ("reinstall torch, torch_npu and CANN as one row of the version matrix (e.g. CANN "
               f"{SEED_ROW.cann} + torch {SEED_ROW.torch} + torch_npu {SEED_ROW.torch_npu})")


def _torch_pin_of_torch_npu() -> tuple[str | None, str | None]:
    """``(torch_npu version, the torch it pins)`` from the installed wheel's metadata (``Requires-Dist:
    torch==2.5.1+cpu`` in 2.5.1, ``torch==2.14.0.*`` in 2.14.0), Nones where unknown."""
    for name in ("torch_npu", "torch-npu"):
        try:
            version = importlib.metadata.version(name)
            requires = importlib.metadata.requires(name) or []
        except Exception:  # PackageNotFoundError, or a broken dist-info
            continue
        for req in requires:
            match = re.match(r"^torch\s*\(?\s*==\s*([0-9][^\s,;)]*)", req.strip())
            if match:
                return version, match.group(1)
        return version, None
    return None, None


def _aarch64() -> bool:
    """This host is an Arm one (Kunpeng: the Atlas 800T A2's host CPU)."""
    import platform

    return platform.machine().lower() in ("aarch64", "arm64")


def _cpu_build_fix(arm: bool | None = None) -> str:
    """The fix for "Two accelerators cannot be used at the same time" beside a CUDA build of torch, for
    the installed torch_npu and this host's architecture (``arm``; default: ``platform.machine()``).

    Both wheels refuse a torch whose ``torch._C._get_accelerator()`` is not the CPU (``torch_npu/__init__.py``:
    at module level in 2.5.1, ``_check_device_conflict`` in 2.14.0), which a CUDA build reports only where a
    CUDA device is visible, so hiding the GPUs works with either. What they pin differs by wheel and by
    architecture (read from the real wheels' METADATA; tests/data/torch_npu_aarch64): x86_64 2.5.1 pins
    ``torch==2.5.1+cpu``, aarch64 2.5.1 ``torch ==2.5.1`` (the CPU index names its aarch64 builds without
    ``+cpu``), 2.14.0 ``torch==2.14.0.*`` on both, which the index's CUDA build satisfies.
    """
    arm = _aarch64() if arm is None else arm
    version, pin = _torch_pin_of_torch_npu()
    suffix, where = ("", "aarch64") if arm else ("+cpu", "x86_64")
    if pin is None:
        return ("install the CPU build of torch that matches torch_npu (e.g. `pip install "
                f"torch=={SEED_ROW.torch}{suffix} --index-url https://download.pytorch.org/whl/cpu` on {where})")
    base = pin.split("+", 1)[0].rstrip(".*")
    cpu = (f"`pip install torch=={base}{suffix} --index-url https://download.pytorch.org/whl/cpu` ({where}; the CPU "
           "build torch_npu runs beside)")
    if pin.endswith("+cpu"):
        return f"torch_npu {version} pins torch=={pin}: install it, {cpu}"
    return (f"torch_npu {version} accepts this build (it pins torch=={pin}) but refuses to load where a CUDA device "
            f"is visible: hide the GPUs from this process (`export CUDA_VISIBLE_DEVICES=`) or install {cpu}")


def _diagnose(exc: BaseException) -> _Diagnosis:
    chain = _exception_chain(exc)
    text = "\n".join(str(e) for e in chain)
    autoload_match = re.search(r"Failed to load the backend extension: ([A-Za-z0-9_\-]+)", text)
    autoload = autoload_match.group(1) if autoload_match else None
    lib_match = _SHARED_LIB.search(text)
    if lib_match:
        lib = lib_match.group(1)
        if lib.startswith(_CANN_LIBS):
            return _Diagnosis("lib_cann", f"{lib} not found", set_env_fix(), autoload, lib)
        return _Diagnosis("lib_other", f"{lib} not found", f"{_MATRIX_FIX} and {set_env_fix()}",
                          autoload, lib)
    if "Two accelerators cannot be used at the same time" in text:
        if "npu and npu" in text:
            return _Diagnosis(
                "two_accelerators",
                "Two accelerators cannot be used at the same time: torch_npu was registered twice "
                "(autoloaded by `import torch` and loaded again by another package)",
                f"set {AUTOLOAD_ENV}=0 and `import torch_npu` once, before other Ascend packages",
                autoload)
        return _Diagnosis(
            "two_accelerators",
            "Two accelerators cannot be used at the same time: torch_npu is installed beside a "
            "CUDA build of torch",
            _cpu_build_fix(), autoload)
    abi = next((e for e in chain if re.search(r"GLIBCXX_[\d.]+' not found|undefined symbol", str(e))),
               None)
    if abi is not None:
        return _Diagnosis("abi", _first_line(abi),
                          f"torch, torch_npu and CANN versions do not match; {_MATRIX_FIX}", autoload)
    guide = next((sentence for sentence in map(troubleshoot.explain_error, chain) if sentence), None)
    if guide is not None:  # the guides' own items (a numpy 2 ABI error: checklist §0.3's pin)
        detail, _, fix = guide.partition(": the ")
        return _Diagnosis("guide", detail, "the " + fix if fix else guide, autoload)
    inner = chain[-1] if autoload and len(chain) > 1 else chain[0]
    return _Diagnosis("other", _first_line(inner),
                      f"check that torch, torch_npu and CANN match the version matrix and "
                      f"{set_env_fix()}", autoload)


def explain_import_error(exc: BaseException) -> str:
    """One sentence, with the fix, for an exception raised by ``import torch`` / ``import torch_npu``.

    Looks at the exception, its ``__cause__`` / ``__context__`` chain and their messages; the
    ``set_env.sh`` path it names comes from :func:`set_env_fix` (the installed toolkit's, else the
    installed wheel's). Known causes (docs/explanation/findings.md, "Devices without hardware"; seed §10.6):

    * torch's device-backend autoload wrapper ("Failed to load the backend extension: torch_npu"),
      combined with the underlying cause and the ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` escape;
    * a CANN shared library not found (libhccl.so, libascendcl.so, …) → source ``set_env.sh``;
    * "Two accelerators cannot be used at the same time" beside a CUDA build of torch, or torch_npu
      registered twice ("npu and npu");
    * ``GLIBCXX_… not found`` / ``undefined symbol`` → versions do not match.

    Anything else gives a generic sentence quoting the first line of the underlying error.
    """
    return _diagnose(exc).sentence()


def not_installed_sentence(torch: str | None, cann: str | None) -> str:
    """The sentence for "torch_npu is not installed", suggesting the wheel for the found CANN/torch."""
    rows = documented_rows(cann=cann) if cann_release(cann) else []
    match = [r for r in rows if r.torch == base_version(torch)]
    if match:
        want = f"torch_npu {match[0].torch_npu} (for torch {match[0].torch} and CANN {match[0].cann})"
    elif rows:
        want = f"a torch/torch_npu pair documented for CANN {cann} ({_suggest(rows)})"
    else:
        want = (f"the torch_npu wheel for torch {base_version(torch) or '?'} and your CANN (e.g. "
                f"CANN {SEED_ROW.cann} + torch {SEED_ROW.torch} + torch_npu {SEED_ROW.torch_npu})")
    return f"torch_npu is not installed — install {want} from the Ascend/pytorch releases"
