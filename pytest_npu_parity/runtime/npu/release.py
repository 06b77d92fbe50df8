"""Which CANN layout and which torch_npu wheel generation this machine has, and what each documents.

Every fact here was read from the released artifacts, not guessed:

* **torch_npu 2.14.0** (``torch_npu-2.14.0-cp311-cp311-manylinux_2_28_x86_64.whl``):
  ``METADATA`` says ``Requires-Dist: torch==2.14.0.*`` (any 2.14.0 build, CUDA or CPU) and its README
  (section "Install CANN") "Install CANN 9.1.0", then (section "Initialize Environment")
  ``source /usr/local/Ascend/cann/set_env.sh``. ``entry_points.txt``: ``[torch.backends] torch_npu =
  torch_npu:_autoload``, ``[torch_dynamo_backends] npu, npugraph_ex, npugraphs`` (``torch_npu.dynamo``)
  and the ``torch_npu_run`` console script.
* **torch_npu 2.5.1 … 2.13.0** (2.5.1, 2.7.1.post11, 2.8.0.post5, 2.9.0.post8/9, 2.9.1,
  2.10.0.post6/7, 2.11.0.post2/3, 2.12.0.post2/3 and 2.13.0 read): the README says
  ``source /usr/local/Ascend/ascend-toolkit/set_env.sh``; ``METADATA`` pins ``torch (==2.5.1+cpu)``
  (2.5.1; ``torch ==2.9.1+cpu`` … ``==2.11.0+cpu``; ``torch ==2.12.0``; ``torch==2.13.0.*``).
* **CANN layouts**: CANN 8.0.0's installation guide ("File Paths", instg_0044) records the version in
  ``/usr/local/Ascend/ascend-toolkit/latest/<arch>-linux/ascend_toolkit_install.info``; CANN 8.5.0's
  in ``/usr/local/Ascend/cann/<arch>-linux/ascend_toolkit_install.info`` (``version=`` line). Both
  wheel generations' ``torch_npu/utils/collect_env.py`` ``get_cann_version`` read the version the same
  way: the first ``ascend_*_install.info`` under ``$ASCEND_HOME_PATH``, its ``version`` line.

Import path without CANN (both generations raise ``ImportError: libhccl.so: cannot open shared
object file``, leave ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` set, and torch's autoload wraps it in
"Failed to load the backend extension: torch_npu"):

* 2.5.1 ``torch_npu/__init__.py`` (module level): sets the switch to 0, ``import torch``, raises
  "Two accelerators cannot be used at the same time" when ``torch._C._get_accelerator().type !=
  "cpu"`` (so also "npu and npu" for a second registration), then ``import torch_npu.npu`` inside a
  ``try`` that appends "Please check that the cann package is installed. Please run 'source
  set_env.sh' in the CANN installation path." to the libhccl/libascendcl ImportError. It restores the
  switch only in ``_autoload`` (called by torch's autoload), so a direct ``import torch_npu`` leaves it 0.
* 2.14.0 ``torch_npu/__init__.py``: the same switch, then ``_check_device_conflict()`` raises only when
  the accelerator is neither ``cpu`` nor ``npu``; ``import torch_npu.utils.patch_getenv`` reaches
  ``torch_npu/npu/utils.py`` ``import torch_npu._C`` first, so the libhccl ImportError arrives
  **without** the added sentence (that lives in ``torch_npu/_init/core/module_loader.py``
  ``_check_npu_import``, which runs later); a successful import ends with ``_autoload()``, restoring
  the switch.
"""
from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class CannLayout:
    """One CANN install layout.

    Attributes:
        name: ``"cann"`` (CANN ≥ 8.5) or ``"ascend-toolkit"`` (CANN ≤ 8.3).
        home: the default toolkit directory (what ``set_env.sh`` exports as ``ASCEND_HOME_PATH``).
        set_env: the default ``set_env.sh`` of that layout.
        source: where the layout is documented.
    """

    name: str
    home: str
    set_env: str
    source: str


CANN_LAYOUT = CannLayout(
    "cann", "/usr/local/Ascend/cann", "/usr/local/Ascend/cann/set_env.sh",
    "CANN 8.5.0 installation guide, File Paths (instg_0044); torch_npu 2.14.0 README, Initialize "
    "Environment")
TOOLKIT_LAYOUT = CannLayout(
    "ascend-toolkit", "/usr/local/Ascend/ascend-toolkit/latest",
    "/usr/local/Ascend/ascend-toolkit/set_env.sh",
    "CANN 8.0.0 installation guide, File Paths (instg_0044); torch_npu 2.5.1 … 2.13.0 READMEs")
#: Newest first.
LAYOUTS = (CANN_LAYOUT, TOOLKIT_LAYOUT)


@dataclasses.dataclass(frozen=True)
class WheelGeneration:
    """What one generation of torch_npu wheels documents and does on import.

    Attributes:
        name: ``"2.14"`` or ``"2.5"`` (the wheel read for it).
        layout: the CANN layout its README's ``source …/set_env.sh`` line names.
        cann: the CANN release its README asks for, or None when it names none for itself.
        restores_autoload: a successful direct ``import torch_npu`` restores
            ``TORCH_DEVICE_BACKEND_AUTOLOAD``.
        refuses_second_npu: "Two accelerators …: npu and npu" is possible (the check is
            ``!= "cpu"`` rather than ``not in ("cpu", "npu")``).
        cann_hint_on_import: the libhccl/libascendcl ImportError carries "Please check that the cann
            package is installed …".
    """

    name: str
    layout: CannLayout
    cann: str | None
    restores_autoload: bool
    refuses_second_npu: bool
    cann_hint_on_import: bool


GENERATION_2_14 = WheelGeneration("2.14", CANN_LAYOUT, "9.1.0", restores_autoload=True,
                                  refuses_second_npu=False, cann_hint_on_import=False)
GENERATION_2_5 = WheelGeneration("2.5", TOOLKIT_LAYOUT, None, restores_autoload=False,
                                 refuses_second_npu=True, cann_hint_on_import=True)

_RELEASE = re.compile(r"^(\d+)\.(\d+)\.(\d+)")


def _release_tuple(version: str | None) -> tuple[int, int, int] | None:
    match = _RELEASE.match((version or "").strip())
    return tuple(int(x) for x in match.groups()) if match else None  # type: ignore[return-value]


def generation(torch_npu_version: str | None) -> WheelGeneration | None:
    """The wheel generation a torch_npu version belongs to (≥ 2.14.0: ``"2.14"``), or None for None.

    The cut is where the README's ``set_env.sh`` path changed (2.13.0 still names ascend-toolkit,
    2.14.0 names cann); releases between 2.5.1 and 2.13.0 are treated as 2.5.1's generation for the
    import behaviour too, which was read only for 2.5.1 and 2.14.0.
    """
    release = _release_tuple(torch_npu_version)
    if release is None:
        return None
    return GENERATION_2_14 if release >= (2, 14, 0) else GENERATION_2_5


def layout_of(home: str | os.PathLike[str]) -> CannLayout:
    """The layout a toolkit directory belongs to: ``…/ascend-toolkit/…`` is the toolkit layout,
    anything else (``/usr/local/Ascend/cann``, ``cann-9.1.0``) the CANN ≥ 8.5 one."""
    return TOOLKIT_LAYOUT if "ascend-toolkit" in Path(home).parts else CANN_LAYOUT


def set_env_path(cann_home: str | os.PathLike[str] | None, torch_npu_version: str | None) -> str:
    """The ``set_env.sh`` to name in a fix.

    Args:
        cann_home: the toolkit directory found (``npu.find_cann().home``), or None.
        torch_npu_version: the installed torch_npu version, or None.

    Returns:
        With a toolkit: its own ``set_env.sh`` where one exists there (``home/set_env.sh``, else the
        parent's, as ``ascend-toolkit/latest`` → ``ascend-toolkit/set_env.sh``), else its layout's
        default. Without one: the path the installed wheel generation's README names, else (no
        torch_npu either) the newest documented layout's.
    """
    if cann_home is not None:
        home = Path(cann_home)
        for candidate in (home / "set_env.sh", home.parent / "set_env.sh"):
            try:
                if candidate.is_file():
                    return str(candidate)
            except OSError:
                continue
        return layout_of(home).set_env
    gen = generation(torch_npu_version)
    return (gen.layout if gen else LAYOUTS[0]).set_env


def set_env_fix(cann_home: str | os.PathLike[str] | None, torch_npu_version: str | None) -> str:
    """``source CANN's set_env.sh (e.g. `source <set_env_path(...)>`)`` — the fix clause of messages."""
    return f"source CANN's set_env.sh (e.g. `source {set_env_path(cann_home, torch_npu_version)}`)"
