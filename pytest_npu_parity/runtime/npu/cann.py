"""Where the CANN toolkit is and which release it is, and the "source set_env.sh" clause of every fix.

Nothing here imports torch or torch_npu: the toolkit's ``version.cfg`` / ``ascend_*_install.info``
files are read, and ``set_env_fix`` names the installed layout's (or the installed wheel's) script.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
from pathlib import Path

from . import release as ascend_release
from .versions import _dist_version, documented_rows

logger = logging.getLogger("pytest_npu_parity.npu")  # the module's logger name before the split

#: Where the CANN toolkit installer puts ``latest`` by default (root install), and the CANN ≥ 8.5
#: layout (``/usr/local/Ascend/cann``; both documented in ``ascend_release``).
#: ``ASCEND_TOOLKIT_HOME`` / ``ASCEND_HOME_PATH`` (exported by CANN's ``set_env.sh``) take precedence.
DEFAULT_TOOLKIT_HOMES = (ascend_release.TOOLKIT_LAYOUT.home, ascend_release.CANN_LAYOUT.home)
TOOLKIT_ENV_VARS = ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")

#: The fix clause for the CANN ≤ 8.3 layout (torch_npu ≤ 2.13 READMEs). Messages use
#: :func:`set_env_fix`, which names the installed layout's (or the installed wheel's) path instead.
SET_ENV_FIX = f"source CANN's set_env.sh (e.g. `source {ascend_release.TOOLKIT_LAYOUT.set_env}`)"


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
