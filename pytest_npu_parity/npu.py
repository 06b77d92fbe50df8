"""Safe detection of torch_npu and CANN, and the NPU compat layer.

Half of a failed NPU port is the environment. This module finds out, without crashing, whether the
Ascend stack (CANN toolkit + torch_npu + a visible NPU) is usable in this process, and turns every
known failure into one sentence that names the fix. The plugin's ``--parity-device npu`` error and
the ``doctor`` command print the same sentences.

Nothing here imports ``torch_npu`` unless it is installed (``importlib.util.find_spec``), and
``torch`` itself is imported lazily: installing torch_npu on a machine without CANN breaks
``import torch`` (device-backend autoload), and this module must still be able to say so.

The compat layer (``register_transfer_to_npu``, ``set_npu_options``, ``bind_device``, and ``launch``,
which runs those three in the launcher's order; ``precision_flags``, ``dist_backend_for``) follows the
Aurora→Ascend adaptation guide (seed ``000_76a3155d974abf2f.txt``, §4.2 launcher steps ①–②, §7.3 HCCL,
§9.4 compile mode).
``probe_ops`` runs small ops on a device and compares them with the CPU; the doctor uses it, and
``needs_fft_fallback`` uses it to decide whether the patch set must run FFTs on the CPU.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import logging
import math
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

from . import ascend_release, troubleshoot

if TYPE_CHECKING:  # torch is imported lazily at run time, see the module docstring
    import torch

logger = logging.getLogger(__name__)

#: Where the CANN toolkit installer puts ``latest`` by default (root install), and the CANN ≥ 8.5
#: layout (``/usr/local/Ascend/cann``; both documented in ``ascend_release``).
#: ``ASCEND_TOOLKIT_HOME`` / ``ASCEND_HOME_PATH`` (exported by CANN's ``set_env.sh``) take precedence.
DEFAULT_TOOLKIT_HOMES = (ascend_release.TOOLKIT_LAYOUT.home, ascend_release.CANN_LAYOUT.home)
TOOLKIT_ENV_VARS = ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")

#: The fix clause for the CANN ≤ 8.3 layout (torch_npu ≤ 2.13 READMEs). Messages use
#: :func:`set_env_fix`, which names the installed layout's (or the installed wheel's) path instead.
SET_ENV_FIX = f"source CANN's set_env.sh (e.g. `source {ascend_release.TOOLKIT_LAYOUT.set_env}`)"
AUTOLOAD_ENV = "TORCH_DEVICE_BACKEND_AUTOLOAD"

# ---------------------------------------------------------------------------------------------
# Versions
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class VersionRow:
    """One documented valid combination of CANN, torch and torch_npu.

    Attributes:
        cann: CANN release, e.g. ``"8.2.RC1"``.
        torch: torch release the torch_npu wheel is built against, e.g. ``"2.5.1"``.
        torch_npu: torch_npu package version, e.g. ``"2.5.1.post1"``.
        source: where the row is documented.
    """

    cann: str
    torch: str
    torch_npu: str
    source: str


_ASCEND = "Ascend/pytorch README, 'Ascend Auxiliary Software' / version-matching table"
_WHEEL_214 = ("torch_npu 2.14.0 wheel METADATA: Requires-Dist torch==2.14.0.*, README 'Install CANN' "
              "(CANN 9.1.0)")
_WHEEL_213 = ("torch_npu 2.13.0 wheel METADATA README, 'Ascend Auxiliary Software' table "
              "(CANN 8.5.0 rows)")
_SEED = "Aurora→Ascend adaptation guide §2.2 (seed 000_76a3155d974abf2f)"

#: Documented valid CANN ↔ torch ↔ torch_npu triples.
#:
#: Sources: the torch_npu project's version table (https://github.com/Ascend/pytorch, README section
#: "Ascend Auxiliary Software", mirrored at https://gitcode.com/Ascend/pytorch, branch names
#: ``v{torch}-{release}``), read for CANN 7.0.0 … 9.1.0; plus the seed guide's own pin
#: CANN 8.2.RC1 ↔ torch 2.5.1 ↔ torch_npu 2.5.1 (the Ascend table lists 2.5.1.post1 for 8.2.RC1 and
#: 2.5.1 for 8.1.RC1; the guide reports 2.5.1 working on 8.2.RC1, so both are accepted).
VERSION_MATRIX: tuple[VersionRow, ...] = tuple(
    VersionRow(cann, torch_v, npu_v, _ASCEND)
    for cann, pairs in (
        ("9.1.0", ("2.12.0/2.12.0", "2.11.0/2.11.0", "2.10.0/2.10.0.post4", "2.9.0/2.9.0.post6",
                   "2.7.1/2.7.1.post8")),
        ("9.0.0", ("2.9.0/2.9.0.post2", "2.8.0/2.8.0.post4", "2.7.1/2.7.1.post4")),
        ("8.5.0", ("2.9.0/2.9.0", "2.8.0/2.8.0.post2", "2.7.1/2.7.1.post2", "2.6.0/2.6.0.post5")),
        ("8.3.RC1", ("2.8.0/2.8.0", "2.7.1/2.7.1", "2.6.0/2.6.0.post3", "2.1.0/2.1.0.post17")),
        ("8.2.RC1", ("2.6.0/2.6.0", "2.5.1/2.5.1.post1", "2.1.0/2.1.0.post13")),
        ("8.1.RC1", ("2.5.1/2.5.1", "2.4.0/2.4.0.post4", "2.3.1/2.3.1.post6", "2.1.0/2.1.0.post12")),
        ("8.0.0", ("2.4.0/2.4.0.post2", "2.3.1/2.3.1.post4", "2.1.0/2.1.0.post10")),
        ("8.0.RC3", ("2.4.0/2.4.0", "2.3.1/2.3.1.post2", "2.1.0/2.1.0.post8")),
        ("8.0.RC2", ("2.3.1/2.3.1", "2.2.0/2.2.0.post2", "2.1.0/2.1.0.post6")),
        ("8.0.RC1", ("2.2.0/2.2.0", "2.1.0/2.1.0.post4")),
        ("7.0.0", ("2.1.0/2.1.0", "2.0.1/2.0.1.post1")),
    )
    for torch_v, npu_v in (pair.split("/") for pair in pairs)
) + (
    # Read from the wheels themselves (ascend_release's docstring). The 2.13.0 wheel names no CANN
    # release for 2.13.0 (its table stops at CANN 8.5.0 ↔ 2.12.0rc1), so 2.13.0 has no row; nor do the
    # index's post releases that no table lists (2.12.0.post2/3, 2.11.0.post2/3, 2.10.0.post6/7,
    # 2.9.1, 2.9.0.post8/9, 2.8.0.post5, 2.7.1.post10/11).
    VersionRow("9.1.0", "2.14.0", "2.14.0", _WHEEL_214),
    VersionRow("8.5.0", "2.12.0", "2.12.0rc1", _WHEEL_213),
    VersionRow("8.5.0", "2.11.0", "2.11.0rc1", _WHEEL_213),
    VersionRow("8.5.0", "2.10.0", "2.10.0rc2", _WHEEL_213),
    VersionRow("8.2.RC1", "2.5.1", "2.5.1", _SEED),
)

#: The combination the seed guide (and this project's Aurora suite) is written for.
SEED_ROW = VERSION_MATRIX[-1]

_ASCEND_TABLE = ("Ascend/pytorch README.zh.md, section 昇腾辅助软件 (the CANN ↔ PyTorch ↔ Extension "
                 "table; torch_npu 2.5.1.post1 and 2.4.0.post4 are also on PyPI)")


def matrix_notes(torch: str | None, torch_npu: str | None, cann: str | None) -> list[str]:
    """Where the seed guide and Ascend's own version table disagree about this combination.

    The guide (seed 000_76a3155d974abf2f §1 "关于 PyTorch 版本" and §2.2) says CANN 8.2.RC1 ↔
    torch 2.5.1 ↔ torch_npu 2.5.1, and that torch 2.4.0's torch_npu stops at CANN 8.0.0. Ascend's
    table (``_ASCEND_TABLE``) pairs CANN 8.2.RC1 with torch_npu **2.5.1.post1** (2.5.1 is its CANN
    8.1.RC1 row) and lists torch_npu 2.4.0.post4 for CANN 8.1.RC1. ``VERSION_MATRIX`` follows
    Ascend's table and keeps the guide's 8.2.RC1 + 2.5.1 row (the guide reports it working).

    Args:
        torch: installed torch version, or None.
        torch_npu: installed torch_npu version, or None.
        cann: CANN version (``cann_version()``), or None.

    Returns:
        One sentence per disagreement that touches the given combination, naming both sources and
        what to install; an empty list when none does. Never a verdict: ``check_version_matrix``
        decides whether a combination is documented.
    """
    notes: list[str] = []
    release = cann_release(cann)
    torch_base = base_version(torch) or base_version(torch_npu)
    if torch_base == "2.4.0":
        notes.append(
            "torch 2.4.0 (Aurora's requirements.txt pin): the adaptation guide (§1) says its torch_npu "
            "stops at CANN 8.0.0, while Ascend's table lists torch_npu 2.4.0.post4 for CANN 8.1.RC1 "
            f"({_ASCEND_TABLE}); neither lists one for CANN 8.2.RC1, so move to torch 2.5.1 there")
    if (torch_npu and _plain_version(torch_npu) == "2.5.1") and release in (None, "8.2.RC1"):
        notes.append(
            "torch_npu 2.5.1: the adaptation guide (§2.2) pairs it with CANN 8.2.RC1, while Ascend's "
            f"table lists it under CANN 8.1.RC1 and pairs CANN 8.2.RC1 with torch_npu 2.5.1.post1 "
            f"({_ASCEND_TABLE}); both are accepted here — prefer 2.5.1.post1 for a new install on "
            "CANN 8.2.RC1")
    return notes

_RELEASE = re.compile(r"^(\d+)\.(\d+)\.(\d+)")
_CANN_RELEASE = re.compile(r"^(\d+\.\d+\.(?:RC\d+|\d+))", re.IGNORECASE)


def base_version(version: str | None) -> str | None:
    """``major.minor.patch`` of a torch / torch_npu version, or None when it has none.

    ``"2.5.1+cpu"`` → ``"2.5.1"``; ``"2.5.1.post1"`` → ``"2.5.1"``; ``"2.1.0.rc1"`` → ``"2.1.0"``.
    torch_npu wheels are built against exactly one torch release, which is this prefix of their
    own version (Ascend/pytorch branch naming ``v{torch}-{release}``).
    """
    if not version:
        return None
    match = _RELEASE.match(version.strip())
    return ".".join(match.groups()) if match else None


def _plain_version(version: str) -> str:
    """Drop a PEP 440 local label: ``"2.5.1.post1+gitabc"`` → ``"2.5.1.post1"``."""
    return version.strip().split("+", 1)[0]


def cann_release(version: str | None) -> str | None:
    """The CANN release a version string belongs to, upper-cased, or None when it has none.

    ``"8.2.rc1"`` → ``"8.2.RC1"``; ``"8.1.RC1.alpha001"`` → ``"8.1.RC1"``; ``"8.5.0"`` →
    ``"8.5.0"``; internal builds such as ``"8.0.T63"`` → None (not a published release).
    """
    if not version:
        return None
    match = _CANN_RELEASE.match(version.strip())
    return match.group(1).upper() if match else None


def documented_rows(*, cann: str | None = None, torch: str | None = None,
                    torch_npu: str | None = None) -> list[VersionRow]:
    """The rows of ``VERSION_MATRIX`` matching every given component (None matches anything).

    CANN is matched by release (``cann_release``), torch by ``base_version``, torch_npu by its
    version without local label.
    """
    rows = list(VERSION_MATRIX)
    if cann is not None:
        rows = [r for r in rows if r.cann == cann_release(cann)]
    if torch is not None:
        rows = [r for r in rows if r.torch == base_version(torch)]
    if torch_npu is not None:
        rows = [r for r in rows if r.torch_npu == _plain_version(torch_npu)]
    return rows


def _suggest(rows: Iterable[VersionRow]) -> str:
    return ", ".join(f"torch {r.torch} + torch_npu {r.torch_npu}" for r in rows)


def check_version_matrix(torch: str | None, torch_npu: str | None, cann: str | None) -> list[str]:
    """Problems with a torch / torch_npu / CANN combination, one sentence (with the fix) each.

    Args:
        torch: installed torch version (``torch.__version__`` or distribution metadata), or None.
        torch_npu: installed torch_npu version, or None when not installed.
        cann: CANN version from ``cann_version()``, or None when not found.

    Returns:
        An empty list when nothing contradicts ``VERSION_MATRIX``. Checks made: torch_npu's torch
        release equals torch's (always required: each wheel is built against one torch release);
        for a CANN release listed in the matrix, torch_npu (or, without torch_npu, torch) is one of
        the releases documented for it. A CANN release absent from the matrix is not a problem
        here (use ``documented_rows`` to warn about it): newer CANN releases appear upstream first.
    """
    problems: list[str] = []
    torch_base, npu_base = base_version(torch), base_version(torch_npu)
    if torch_base and npu_base and torch_base != npu_base:
        problems.append(version_mismatch_sentence(torch, torch_npu))
    release = cann_release(cann)
    rows_for_cann = documented_rows(cann=release) if release else []
    if rows_for_cann and torch_npu:
        if not documented_rows(cann=release, torch_npu=torch_npu):
            elsewhere = sorted({r.cann for r in documented_rows(torch_npu=torch_npu)})
            where = (f"; torch_npu {torch_npu} is documented for CANN {', '.join(elsewhere)}"
                     if elsewhere else "")
            problems.append(
                f"CANN {cann} and torch_npu {torch_npu} are not a documented pair{where} — install "
                f"one row of the version matrix for CANN {release} ({_suggest(rows_for_cann)}) "
                f"or the CANN release your torch_npu was built for"
            )
    elif rows_for_cann and torch and not torch_npu:
        if not documented_rows(cann=release, torch=torch):
            problems.append(
                f"CANN {cann} has no torch_npu release for torch {torch} — install one row of the "
                f"version matrix for CANN {release} ({_suggest(rows_for_cann)})"
            )
    return problems


def version_mismatch_sentence(torch: str | None, torch_npu: str | None) -> str:
    """The sentence for a torch_npu wheel built against another torch release than the installed one."""
    want = base_version(torch_npu)
    return (
        f"torch_npu {torch_npu} is built for torch {want}, but torch {torch} is installed — "
        f"install torch {want} (the CPU build) or the torch_npu release built for torch "
        f"{base_version(torch)}; torch, torch_npu and CANN must be one row of the version matrix"
    )


def _dist_version(name: str) -> str | None:
    """Installed distribution version from metadata, without importing the package; never raises."""
    for candidate in (name, name.replace("_", "-")):
        try:
            return importlib.metadata.version(candidate)
        except Exception:  # PackageNotFoundError, or a broken dist-info
            continue
    return None


def _find_spec(name: str) -> Any:
    """``importlib.util.find_spec`` for a top-level name that never raises (None on any error)."""
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):  # ValueError: sys.modules[name] is None or has no __spec__
        return None


# ---------------------------------------------------------------------------------------------
# CANN
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CannInfo:
    """Where the CANN toolkit was found.

    Attributes:
        version: CANN release string as the toolkit reports it, e.g. ``"8.2.RC1"``.
        home: the toolkit directory (``…/ascend-toolkit/latest``).
        source: the file the version was read from.
    """

    version: str
    home: str
    source: str


def _read_version_cfg(path: Path) -> str | None:
    """CANN version from ``version.cfg``.

    Format (CANN 7.x–8.x ``ascend-toolkit/latest/version.cfg``)::

        # version: 1.0
        runtime_running_version=[7.7.0.1.231:8.2.RC1]
        toolkit_running_version=[7.7.0.1.231:8.2.RC1]

    i.e. ``<component>_running_version=[<inner build>:<CANN version>]``. Old toolkits write
    ``[1.83.T8.0.B128:CANN-1.83]``; the ``CANN-`` prefix is dropped. The toolkit entry is preferred,
    then runtime, then any ``*_running_version``.
    """
    values: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines()[:200]:
        match = re.match(r"^\s*(\w+)_running_version\s*=\s*\[([^\]]*)\]", line)
        if match:
            values.setdefault(match.group(1), match.group(2))
    for key in ("toolkit", "runtime", *values):
        raw = values.get(key)
        if raw:
            version = raw.rsplit(":", 1)[-1].strip()
            version = version[5:] if version.upper().startswith("CANN-") else version
            if version:
                return version
    return None


def _read_install_info(path: Path) -> str | None:
    """CANN version from ``<arch>-linux/ascend_toolkit_install.info``.

    Format (key=value lines)::

        package_name=Ascend-cann-toolkit
        version=8.2.RC1
        innerversion=V100R001C22SPC001B231
        arch=aarch64
    """
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines()[:200]:
        key, sep, value = line.partition("=")
        if sep and key.strip() == "version" and value.strip():
            return value.strip()
    return None


def _toolkit_candidates(toolkit_path: str | os.PathLike[str] | None) -> list[Path]:
    if toolkit_path is not None:
        return [Path(toolkit_path)]
    homes = [os.environ.get(var) for var in TOOLKIT_ENV_VARS]
    return [Path(h) for h in dict.fromkeys([*(h for h in homes if h), *DEFAULT_TOOLKIT_HOMES])]


def _version_files(home: Path) -> list[Path]:
    """The files that may hold the version, in order: ``version.cfg`` (CANN 7.x–8.x), the toolkit's
    ``[<arch>-linux/]ascend_toolkit_install.info`` (both layouts: CANN 8.0.0 and 8.5.0 installation
    guides, "File Paths"), then any other ``ascend_*_install.info`` there, the pattern torch_npu's own
    ``torch_npu/utils/collect_env.py`` ``get_cann_version`` reads (2.5.1 and 2.14.0 wheels)."""
    files = [home / "version.cfg", home / "ascend_toolkit_install.info",
             *sorted(home.glob("*-linux/ascend_toolkit_install.info")),
             *sorted(home.glob("ascend_*_install.info")), *sorted(home.glob("*-linux/ascend_*_install.info"))]
    return list(dict.fromkeys(files))


def find_cann(toolkit_path: str | os.PathLike[str] | None = None) -> CannInfo | None:
    """Locate the CANN toolkit and read its version; never raises.

    Args:
        toolkit_path: the toolkit directory (``…/ascend-toolkit/latest``) or a ``version.cfg`` /
            ``ascend_toolkit_install.info`` file. When None, tries ``$ASCEND_TOOLKIT_HOME``,
            ``$ASCEND_HOME_PATH`` (both exported by ``set_env.sh``), then
            ``/usr/local/Ascend/ascend-toolkit/latest`` and ``/usr/local/Ascend/cann``.

    Returns:
        The first toolkit whose ``version.cfg`` or ``*-linux/ascend_toolkit_install.info`` yields a
        version, or None (no toolkit, unreadable or malformed files).
    """
    for home in _toolkit_candidates(toolkit_path):
        try:
            if home.is_file():
                files = [home]
                home = home.parent
            else:
                files = _version_files(home)
            for file in files:
                if not file.is_file():
                    continue
                reader = _read_version_cfg if file.suffix == ".cfg" else _read_install_info
                version = reader(file)
                if version:
                    return CannInfo(version=version, home=str(home), source=str(file))
        except (OSError, ValueError) as exc:
            logger.debug("cannot read CANN version under %s: %s", home, exc)
    return None


def cann_version(toolkit_path: str | os.PathLike[str] | None = None) -> str | None:
    """CANN version string (e.g. ``"8.2.RC1"``) of the toolkit ``find_cann`` finds, or None."""
    info = find_cann(toolkit_path)
    return info.version if info else None


def set_env_fix(cann: CannInfo | None = None, torch_npu: str | None = None) -> str:
    """The "source CANN's set_env.sh (e.g. `source PATH`)" clause of every fix sentence.

    PATH is the installed toolkit's ``set_env.sh`` (``find_cann`` unless ``cann`` is given), else the
    one the installed torch_npu wheel's README names (``torch_npu`` or its metadata): 2.14.0 says
    ``/usr/local/Ascend/cann/set_env.sh``, 2.5.1 … 2.13.0 ``/usr/local/Ascend/ascend-toolkit/set_env.sh``
    (``ascend_release.set_env_path``). Never raises.
    """
    info = cann if cann is not None else find_cann()
    return ascend_release.set_env_fix(info.home if info else None,
                                      torch_npu or _dist_version("torch_npu"))


def _looked_in() -> str:
    return ", ".join([f"${v}" for v in TOOLKIT_ENV_VARS] + list(DEFAULT_TOOLKIT_HOMES))


def _wanted_cann(torch_npu: str | None) -> str:
    """`` 9.1.0`` (the CANN releases documented for this torch_npu), or ``""``."""
    rows = documented_rows(torch_npu=torch_npu) if torch_npu else []
    return f" {' or '.join(sorted({r.cann for r in rows}))}" if rows else ""


def cann_missing_sentence(torch_npu: str | None = None) -> str:
    """The sentence for "no CANN toolkit found", naming where it was looked for."""
    return (
        f"CANN toolkit not found (no version.cfg or ascend_toolkit_install.info under "
        f"{_looked_in()}) — install the CANN toolkit{_wanted_cann(torch_npu)} matching torch_npu and "
        f"{set_env_fix(torch_npu=torch_npu)}"
    )


# ---------------------------------------------------------------------------------------------
# Failure sentences
# ---------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------
# Status
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# Compat layer (seed §4.2, §7.3, §9.4)
# ---------------------------------------------------------------------------------------------


def register_transfer_to_npu() -> bool:
    """Import ``torch_npu.contrib.transfer_to_npu`` when an NPU is available.

    That module redirects ``tensor.cuda()`` / ``torch.cuda.*`` / ``device="cuda"`` to the NPU for
    the whole process, irreversibly (it also maps fp64 tensor types to fp32 — docs/explanation/findings.md). The seed
    guide imports it before ``import aurora`` (§4.2 step ①) so that modules built afterwards land
    on the NPU.

    Returns:
        True when registered; False (no-op, reason logged at INFO) when no NPU is available.

    Raises:
        ImportError: torch_npu is available but its ``contrib.transfer_to_npu`` fails to import.
    """
    status = npu_status()
    if not status.available:
        logger.info("transfer_to_npu not registered: %s", status.reason)
        return False
    importlib.import_module("torch_npu.contrib.transfer_to_npu")
    return True


def _parse_device_type(device: Any) -> str:
    """Device type of a ``torch.device`` or device string, e.g. ``"npu:1"`` → ``"npu"``."""
    kind = getattr(device, "type", None)
    if isinstance(kind, str):
        return kind
    if isinstance(device, str):
        match = re.match(r"^\s*([A-Za-z_][\w]*)(?::\d+)?\s*$", device)
        if match:
            return match.group(1).lower()
    raise ValueError(f"{device!r} is not a device: give a torch.device or a string like 'npu:0'")


def bind_device(local_rank: int, *, device_type: str | None = None) -> "torch.device":
    """Bind this process to its accelerator for ``local_rank`` and return the device (seed §4.2 ②).

    Args:
        local_rank: process index on this node (``LOCAL_RANK`` under torchrun), ≥ 0.
        device_type: ``"npu"``, ``"cuda"`` or ``"cpu"``; None picks npu > cuda > cpu by availability.

    Returns:
        ``torch.device("npu", local_rank)`` after ``torch.npu.set_device(local_rank)`` (required
        before ``init_process_group("hccl")``, seed §7.3 ③), ``torch.device("cuda", local_rank)``
        after ``torch.cuda.set_device``, or ``torch.device("cpu")``.

    Raises:
        ValueError: negative ``local_rank``, unknown ``device_type``, or ``local_rank`` beyond the
            visible devices (the message gives the count and ASCEND_RT_VISIBLE_DEVICES /
            CUDA_VISIBLE_DEVICES).
        RuntimeError: ``device_type="npu"`` but no NPU is available (message: ``npu_status`` reason).
    """
    if not isinstance(local_rank, int) or isinstance(local_rank, bool) or local_rank < 0:
        raise ValueError(f"local_rank must be an int >= 0, got {local_rank!r}")
    torch = import_torch()
    if device_type is None:
        device_type = ("npu" if npu_status().available
                       else "cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cpu":
        return torch.device("cpu")
    if device_type == "npu":
        status = npu_status()
        if not status.available:
            raise RuntimeError(f"cannot bind an NPU: {status.reason}")
        count, env = status.device_count, "ASCEND_RT_VISIBLE_DEVICES"
    elif device_type == "cuda":
        count, env = torch.cuda.device_count(), "CUDA_VISIBLE_DEVICES"
    else:
        raise ValueError(f"device_type must be 'npu', 'cuda' or 'cpu', got {device_type!r}")
    if local_rank >= count:
        raise ValueError(f"local_rank {local_rank} but only {count} {device_type} device(s) are "
                         f"visible ({env}={os.environ.get(env, 'unset')}) — start at most {count} "
                         f"processes per node or widen {env}")
    getattr(torch, device_type).set_device(local_rank)
    return torch.device(device_type, local_rank)


def set_npu_options() -> bool:
    """Turn off torch_npu's JIT operator compilation: ``torch_npu.npu.set_compile_mode(jit_compile=False)``.

    With ``jit_compile=False`` torch_npu uses CANN's precompiled binary kernels instead of
    compiling operators online, so there is no compile cost after the first call (seed §9.4; the
    guide's ``npu_compat.set_npu_options()`` does this at import). Numerics are those of the binary
    kernels; a parity run should record the mode it ran with.

    Returns:
        True when applied; False (no-op, reason logged at INFO) when no NPU is available.
    """
    status = npu_status()
    if not status.available:
        logger.info("NPU options not set: %s", status.reason)
        return False
    torch_npu = importlib.import_module("torch_npu")
    torch_npu.npu.set_compile_mode(jit_compile=False)
    return True


class LaunchOrderError(RuntimeError):
    """A package the launcher must precede (``LAUNCH_BEFORE``) was imported before :func:`launch` ran."""


@dataclasses.dataclass(frozen=True)
class LaunchRecord:
    """What :func:`launch` did in this process, in order.

    Attributes:
        device: the bound device, e.g. ``"npu:1"``.
        steps: the steps in the order they ran: ``"transfer_to_npu"``,
            ``"set_compile_mode(jit_compile=False)"``, ``"set_device(1)"``.
    """

    device: str
    steps: tuple[str, ...]

    def describe(self) -> str:
        """One line for the report header and the doctor, e.g. ``transfer_to_npu → … → set_device(0)``."""
        return " → ".join(self.steps)


#: Top-level packages that must be imported only after :func:`launch` (seed §4.2, "关键保证": npu_compat
#: must be loaded before ``import aurora``, else aurora's modules and parameters are created before
#: ``transfer_to_npu`` redirects them).
LAUNCH_BEFORE: tuple[str, ...] = ("aurora",)
_LAUNCHED: LaunchRecord | None = None


def _device_index(device: Any) -> int:
    """Index of a ``torch.device`` or device string (``"npu:1"`` → 1; no index → 0)."""
    if isinstance(device, str):
        match = re.match(r"^\s*[A-Za-z_]\w*:(\d+)\s*$", device)
        return int(match.group(1)) if match else 0
    return int(getattr(device, "index", None) or 0)


def launch(device: "torch.device | str") -> LaunchRecord | None:
    """Do for an NPU target what the Ascend guide's launcher does before ``import aurora``.

    The guide's ``aurora_launcher.py`` (seed ``000_76a3155d974abf2f.txt`` §4.2) runs, before any
    upstream code: ① ``import npu_compat`` — registers ``torch_npu.contrib.transfer_to_npu`` and
    (§9.4: "npu_compat.set_npu_options() 已在导入时自动设置") sets
    ``torch_npu.npu.set_compile_mode(jit_compile=False)``; ② ``setup_device(local_rank)`` —
    ``torch.npu.set_device`` (before HCCL, §7.3 ③). This does the same, in that order:
    :func:`register_transfer_to_npu`, :func:`set_npu_options`, :func:`bind_device` with the
    target's index. The compile mode matters for numerics and layout, not only for speed: torch_npu
    2.5.1 casts BatchNorm weights to an internal format (NC1HWC0) when a module is moved to the NPU
    unless ``torch.npu.is_jit_compile_false()`` (``torch_npu/utils/_module.py``), so it is set before
    any model is built or moved.

    Called by the pytest plugin at session start (every xdist worker with its own pinned device),
    by every spawned data-parallel rank (``distributed``) and by the doctor. Idempotent: a second
    call for the same device returns the first record; a call for another device binds that one.

    Args:
        device: the target (``torch.device`` or ``"npu:N"``).

    Returns:
        The ``LaunchRecord``, or None for a CPU/CUDA target (nothing is done or imported there).

    Raises:
        LaunchOrderError: on the first launch of the process, ``aurora`` is already imported (the
            message names the fix).
        RuntimeError: no NPU is available (the message is ``npu_status().reason``).
        ValueError: as :func:`bind_device` (an index beyond the visible NPUs).
    """
    global _LAUNCHED
    if _parse_device_type(device) != "npu":
        return None
    index = _device_index(device)
    with _STATUS_LOCK:
        if _LAUNCHED is not None:
            if _LAUNCHED.device != f"npu:{index}":
                bind_device(index, device_type="npu")
                _LAUNCHED = dataclasses.replace(_LAUNCHED, device=f"npu:{index}",
                                                steps=_LAUNCHED.steps + (f"set_device({index})",))
            return _LAUNCHED
        early = [name for name in LAUNCH_BEFORE if sys.modules.get(name) is not None]
        if early:
            raise LaunchOrderError(
                f"{', '.join(early)} was imported before the NPU launcher steps (transfer_to_npu, compile mode, "
                f"set_device) — the Ascend guide requires them first (seed §4.2), else its modules are built "
                f"before transfer_to_npu redirects them; import {early[0]} inside a fixture or function, not at "
                "the top of a conftest or plugin")
        if not register_transfer_to_npu():
            raise RuntimeError(f"cannot prepare {device} for the run: {npu_status().reason}")
        steps = ["transfer_to_npu"]
        set_npu_options()
        steps.append("set_compile_mode(jit_compile=False)")
        bind_device(index, device_type="npu")
        steps.append(f"set_device({index})")
        _LAUNCHED = LaunchRecord(f"npu:{index}", tuple(steps))
        return _LAUNCHED


def launched() -> LaunchRecord | None:
    """The record of :func:`launch` in this process, or None when it has not run (or not on an NPU)."""
    return _LAUNCHED


#: The adaptation guide's warning for fp16 on an NPU (seed ``000_76a3155d974abf2f.txt`` §6.3:
#: "WARNING [NPU] 检测到 FP16 精度。昇腾 910B 原生支持 BF16 且无需 loss scaling，强烈建议改用
#: --precision bf16 以获得更好的稳定性与性能。"; §9.1 likewise), in English, with our option.
FP16_NPU_WARNING = ("WARNING [NPU] fp16 precision selected: the Ascend 910B supports bf16 natively and needs no "
                    "loss scaling; the adaptation guide strongly recommends bf16 (--parity-dtypes bf16) for better "
                    "stability and performance")


def fp16_warning(device: "torch.device | str", recipes: Iterable[str]) -> str | None:
    """``FP16_NPU_WARNING`` when ``device`` is an NPU and ``recipes`` include ``fp16``, else None."""
    return FP16_NPU_WARNING if _parse_device_type(device) == "npu" and "fp16" in set(recipes) else None


def precision_flags() -> dict[str, bool | str]:
    """The reduced-precision switches in force now, keyed like ``recipes.precision_flags``.

    Keys: ``float32_matmul_precision`` (``"highest"`` | ``"high"`` | ``"medium"``),
    ``cuda.matmul.allow_tf32``, ``cudnn.allow_tf32`` and — only when an NPU is available —
    ``npu.matmul.allow_hf32`` and ``npu.conv.allow_hf32`` (torch_npu API
    ``torch.npu.matmul.allow_hf32`` / ``torch.npu.conv.allow_hf32``; torch_npu turns conv HF32 ON
    by default, matmul off — docs/explanation/findings.md). TF32/HF32 keep 10 mantissa bits, so fp32 parity needs
    them off.

    Raises:
        ImportError / RuntimeError: torch cannot be imported.
    """
    import_torch()  # safely, before recipes imports torch
    from .recipes import precision_flags as _flags

    return _flags()


_DIST_BACKENDS = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}


def dist_backend_for(device: "torch.device | str") -> str:
    """The ``torch.distributed`` backend for a device, chosen by device type.

    ``npu`` → ``"hccl"`` (registered by ``import torch_npu``, seed §7.3), ``cuda`` → ``"nccl"``,
    ``cpu`` → ``"gloo"``.

    Raises:
        ValueError: any other device type, or a string that is not a device.
    """
    kind = _parse_device_type(device)
    try:
        return _DIST_BACKENDS[kind]
    except KeyError:
        raise ValueError(f"no distributed backend known for device type {kind!r} ({device!r}); "
                         f"known: {', '.join(f'{k}→{v}' for k, v in _DIST_BACKENDS.items())}") from None


# ---------------------------------------------------------------------------------------------
# Op probes
# ---------------------------------------------------------------------------------------------

#: Tolerance for fp32 ops without long reductions. Loose on purpose: a probe asks "does the op run
#: on the target and compute the same function", not "is it bit-for-bit parity" (that is the
#: suite's job). 1e-3 is torch_npu's own ``assertRtolEqual`` default (DESIGN anchors).
_TOL_ELEMENTWISE = (1e-3, 1e-3)
#: Tolerance for fp32 ops with inner products (linear, matmul, SDPA, conv, einsum, FFT, pinv):
#: 10× the unit roundoff of HF32/TF32 (10 explicit mantissa bits → 2**-11 ≈ 4.9e-4), because
#: torch_npu runs conv in HF32 by default and CUDA may run matmuls in TF32.
_TOL_REDUCTION = (5e-3, 5e-3)
#: Tolerance for bf16: ``torch.testing.assert_close``'s bf16 rtol (1.6e-2 ≈ 2 bf16 ulps), atol 1e-3.
_TOL_BF16 = (1.6e-2, 1e-3)


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One op probe: CPU inputs from a seeded generator, the op, and its tolerance.

    Attributes:
        name: probe name (``"linear"``, ``"rfft"``…).
        make_inputs: ``generator -> tuple of CPU tensors`` (fp32 unless stated).
        fn: the op, applied to the inputs on the CPU and on the target.
        rtol, atol: ``torch.allclose`` tolerance of target vs CPU.
        what: one-line description for reports.
    """

    name: str
    make_inputs: Callable[[Any], tuple]
    fn: Callable[..., Any]
    rtol: float
    atol: float
    what: str


@dataclasses.dataclass(frozen=True)
class OpProbe:
    """Result of probing one op on a device.

    Attributes:
        name: probe name.
        ok: ran on the device, the output stayed on the device, and allclose to the CPU result.
        ran: the op ran on the device without raising.
        max_abs_diff: max |target − CPU| over the output (complex outputs as real pairs), or None.
        rtol, atol: tolerance used.
        output_device: device of the target output (e.g. ``"npu:0"``), or None.
        error: first line of the exception, or why the comparison failed; None when ok.
        seconds: wall time of the target run including the copy back to the host.
    """

    name: str
    ok: bool
    ran: bool
    max_abs_diff: float | None
    rtol: float
    atol: float
    output_device: str | None
    error: str | None
    seconds: float


def _op_specs() -> dict[str, OpSpec]:
    torch = import_torch()
    F = torch.nn.functional

    def randn(*shape):
        return lambda g: torch.randn(*shape, generator=g)

    def inputs(*makers):
        return lambda g: tuple(m(g) for m in makers)

    def complex_spectrum(g):
        return (torch.fft.rfft(torch.randn(2, 4, 32, generator=g), dim=-1),)

    def well_conditioned(g):
        return (torch.randn(16, 12, generator=g) + 3 * torch.eye(16, 12),)

    specs = [
        OpSpec("linear", inputs(randn(4, 32), randn(16, 32), randn(16)),
               lambda x, w, b: F.linear(x, w, b), *_TOL_REDUCTION, "F.linear (nn.Linear)"),
        OpSpec("matmul", inputs(randn(4, 8, 32), randn(32, 16)),
               lambda a, b: a @ b, *_TOL_REDUCTION, "batched matmul"),
        OpSpec("sdpa", inputs(randn(2, 4, 8, 16), randn(2, 4, 8, 16), randn(2, 4, 8, 16)),
               lambda q, k, v: F.scaled_dot_product_attention(q, k, v), *_TOL_REDUCTION,
               "F.scaled_dot_product_attention (nn.Transformer layers)"),
        OpSpec("layer_norm", inputs(randn(4, 32), randn(32), randn(32)),
               lambda x, w, b: F.layer_norm(x, (32,), w, b), *_TOL_ELEMENTWISE, "F.layer_norm"),
        OpSpec("softmax", inputs(randn(4, 8, 16)), lambda x: F.softmax(x, dim=-1),
               *_TOL_ELEMENTWISE, "F.softmax"),
        OpSpec("gelu", inputs(randn(4, 32)), F.gelu, *_TOL_ELEMENTWISE, "F.gelu (ViT, BERT)"),
        OpSpec("silu", inputs(randn(4, 32)), F.silu, *_TOL_ELEMENTWISE, "F.silu (Aurora MLPs)"),
        OpSpec("batch_norm", inputs(randn(8, 16, 10), randn(16), randn(16)),
               lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True),
               *_TOL_ELEMENTWISE, "F.batch_norm, batch statistics (nn.BatchNorm1d in train mode)"),
        OpSpec("conv2d", inputs(randn(1, 3, 16, 16), randn(8, 3, 4, 4)),
               lambda x, w: F.conv2d(x, w, stride=4), *_TOL_REDUCTION,
               "F.conv2d with stride = kernel (ViT patch embedding)"),
        OpSpec("einsum", inputs(randn(2, 2, 4, 6), randn(6, 5), randn(2, 2, 3, 5)),
               lambda a, w, b: torch.einsum("bhik,kl,bhjl->bhij", a, w, b), *_TOL_REDUCTION,
               "torch.einsum (Aurora guided attention bias)"),
        OpSpec("topk", inputs(randn(4, 33)), lambda x: torch.topk(x, 3, dim=-1).values,
               *_TOL_ELEMENTWISE, "torch.topk values (Aurora period search)"),
        OpSpec("interpolate", inputs(randn(1, 4, 10)),
               lambda x: F.interpolate(x, size=16, mode="linear"), *_TOL_ELEMENTWISE,
               "F.interpolate(mode='linear') (Aurora resample)"),
        OpSpec("sin_cos_exp", inputs(randn(4, 32)),
               lambda x: torch.cat([torch.sin(x), torch.cos(x), torch.exp(-x.abs())], dim=-1),
               *_TOL_ELEMENTWISE, "sin/cos/exp/cat (timestep embedding)"),
        OpSpec("rfft", inputs(randn(2, 4, 32)), lambda x: torch.fft.rfft(x, dim=-1),
               *_TOL_REDUCTION, "torch.fft.rfft, fp32 (needs CANN >= 8.2 on NPU, seed §5.3)"),
        OpSpec("irfft", complex_spectrum, lambda s: torch.fft.irfft(s, n=32, dim=-1),
               *_TOL_REDUCTION, "torch.fft.irfft, fp32 (needs CANN >= 8.2 on NPU, seed §5.3)"),
        OpSpec("pinv", well_conditioned, torch.linalg.pinv, *_TOL_REDUCTION,
               "torch.linalg.pinv (Aurora patch-size resample)"),
        OpSpec("linear_bf16", lambda g: tuple(t.to(torch.bfloat16) for t in
                                              (torch.randn(4, 32, generator=g),
                                               torch.randn(16, 32, generator=g))),
               lambda x, w: F.linear(x, w), *_TOL_BF16, "F.linear in bfloat16 (bf16 recipes)"),
    ]
    return {s.name: s for s in specs}


#: Ops every Aurora forward needs on the target (an NPU port without them cannot run).
REQUIRED_OPS: tuple[str, ...] = ("linear", "matmul", "sdpa", "layer_norm", "softmax", "gelu",
                                 "silu", "batch_norm", "conv2d", "einsum", "topk", "interpolate",
                                 "sin_cos_exp")
#: Ops the patch set can move to the CPU when the target lacks them (FFT, pinv), plus bf16 support.
OPTIONAL_OPS: tuple[str, ...] = ("rfft", "irfft", "pinv", "linear_bf16")


def _as_real(t: Any) -> Any:
    torch = sys.modules["torch"]
    return torch.view_as_real(t) if t.is_complex() else t


def probe_ops(device: "torch.device | str", ops: Iterable[str] = REQUIRED_OPS + OPTIONAL_OPS,
              *, seed: int = 0) -> dict[str, OpProbe]:
    """Run each op on ``device`` and compare it with the same op on the CPU.

    Inputs are small (≤ 2·4·8·16 elements), drawn on the CPU from ``torch.Generator`` seeded with
    ``seed`` and copied to the device; the CPU result is the reference. An op passes when it runs,
    its output lies on ``device``'s type, and ``torch.allclose(target.cpu(), cpu, rtol, atol)``
    (tolerances per op, see ``_TOL_*``). On ``device="cpu"`` the comparison is CPU with itself, so
    it checks only that each op runs.

    Args:
        device: target device (``torch.device`` or string such as ``"npu:0"``).
        ops: probe names, a subset of ``REQUIRED_OPS + OPTIONAL_OPS``.
        seed: generator seed for the inputs.

    Returns:
        ``{name: OpProbe}`` in the order given; never raises for an op that fails on the device.

    Raises:
        ValueError: an unknown op name (the message lists the known ones) or a bad device string.
    """
    torch = import_torch()
    device = torch.device(device)
    specs = _op_specs()
    names = list(ops)
    unknown = [n for n in names if n not in specs]
    if unknown:
        raise ValueError(f"unknown op probe(s) {', '.join(unknown)}; known: {', '.join(specs)}")
    results: dict[str, OpProbe] = {}
    for name in names:
        spec = specs[name]
        generator = torch.Generator().manual_seed(seed)
        cpu_inputs = spec.make_inputs(generator)
        reference = spec.fn(*cpu_inputs)
        start = time.perf_counter()
        try:
            out = spec.fn(*(t.to(device) for t in cpu_inputs))
            out_device = str(out.device)
            host = out.cpu()
        except Exception as exc:
            results[name] = OpProbe(name, False, False, None, spec.rtol, spec.atol, None,
                                    _first_line(exc), time.perf_counter() - start)
            continue
        seconds = time.perf_counter() - start
        got, want = _as_real(host).double(), _as_real(reference).double()
        diff = float((got - want).abs().max()) if got.numel() else 0.0
        error = None
        if out.device.type != device.type:
            error = f"output on {out_device}, expected {device.type}"
        elif got.shape != want.shape:
            error = f"shape {tuple(got.shape)} on the target vs {tuple(want.shape)} on the CPU"
        elif not torch.allclose(got, want, rtol=spec.rtol, atol=spec.atol):
            error = (f"max |target - cpu| = {diff:.3g} beyond rtol={spec.rtol:g}, "
                     f"atol={spec.atol:g}")
        results[name] = OpProbe(name, error is None, True, diff if math.isfinite(diff) else None,
                                spec.rtol, spec.atol, out_device, error, seconds)
    return results


def needs_fft_fallback(device: "torch.device | str") -> bool:
    """Whether ``torch.fft.rfft``/``irfft`` must run on the CPU for ``device``.

    True when either FFT probe fails on the device (CANN < 8.2 lacks them on the NPU, seed §5.3 /
    §10.3); always False on the CPU. The patch set's ``fft_fallback`` takes this value.
    """
    torch = import_torch()
    if torch.device(device).type == "cpu":
        return False
    return not all(p.ok for p in probe_ops(device, ("rfft", "irfft")).values())
