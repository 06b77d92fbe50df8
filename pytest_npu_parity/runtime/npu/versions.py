"""Which CANN ↔ torch ↔ torch_npu combinations are documented, and what is wrong with one that is not.

``VERSION_MATRIX`` holds the documented triples; ``check_version_matrix`` and ``matrix_notes`` say, one
sentence each, what contradicts it; ``_dist_version`` / ``_find_spec`` read what is installed without
importing it.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import re
from typing import Any, Iterable


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
