"""Build fake Ascend environments for tests and run Python in them.

The fakes stand in for what a CPU-only machine lacks:

* ``torch_npu_stub/torch_npu`` — a stub package (see its docstring for ``FAKE_TORCH_NPU_MODE``);
  ``build_site`` copies it into a fresh directory next to a ``torch_npu-<version>.dist-info`` so
  that ``importlib.metadata`` reports the chosen version and, with ``autoload=True``, torch's
  device-backend autoload (entry-point group ``torch.backends``) loads it on ``import torch``
  exactly as it loads the real wheel.
* ``ascend-toolkit/latest`` — a CANN toolkit directory with a real-format ``version.cfg`` and
  ``x86_64-linux/ascend_toolkit_install.info`` (CANN 8.2.RC1), the CANN ≤ 8.3 layout;
  ``cann`` — the CANN ≥ 8.5 layout (``/usr/local/Ascend/cann``): only
  ``x86_64-linux/ascend_toolkit_install.info`` (CANN 9.1.0) and a ``set_env.sh`` beside it.
* ``bin/npu-smi`` — prints the ``npu-smi info`` device table.
* ``import_hook/sitecustomize.py`` — with ``fake_env(event_log=...)``, logs every interpreter's first
  ``import aurora`` into the stub's event log (order of launcher steps vs. that import).

Everything that imports the stub runs in a subprocess (``run_python``), so the test process's
real torch never sees it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

FAKES = Path(__file__).resolve().parent
REPO_ROOT = FAKES.parent.parent
STUB_PACKAGE = FAKES / "torch_npu_stub" / "torch_npu"
TOOLKIT_HOME = FAKES / "ascend-toolkit" / "latest"
CANN_HOME = FAKES / "cann"
#: Wheel generations the stub can stand for (``ascend_release.GENERATION_2_5`` / ``GENERATION_2_14``).
GENERATIONS = ("2.5", "2.14")
BIN_DIR = FAKES / "bin"
IMPORT_HOOK_DIR = FAKES / "import_hook"

#: Environment variables that would let the host's own Ascend setup leak into a test.
_SCRUBBED = ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH", "ASCEND_RT_VISIBLE_DEVICES",
             "TORCH_DEVICE_BACKEND_AUTOLOAD", "PYTHONPATH", "FAKE_TORCH_NPU_MODE",
             "FAKE_NPU_DEVICE_COUNT", "FAKE_NPU_NAME", "FAKE_NPU_SMI_HEALTH",
             "NPU_PARITY_TORCH_NPU_UNUSABLE", "FAKE_NPU_EVENT_LOG", "FAKE_BLOCK_AURORA_IMPORT",
             "FAKE_NPU_HCCL")


def _torch_release(version: str) -> str:
    """The torch release a torch_npu version is built for (``2.5.1.post1`` → ``2.5.1``)."""
    return ".".join(version.split(".")[:3])


def default_generation(version: str) -> str:
    """The wheel generation a torch_npu version stands for (``ascend_release.generation``)."""
    release = tuple(int(x) for x in _torch_release(version).split(".") if x.isdigit())
    return "2.14" if release >= (2, 14, 0) else "2.5"


def build_site(dest: Path, *, version: str, autoload: bool = True, generation: str | None = None) -> Path:
    """Install the stub as ``torch_npu`` ``version`` into ``dest`` (a directory for PYTHONPATH).

    Args:
        dest: empty or new directory.
        version: the torch_npu version the dist-info declares, e.g. ``"2.5.1.post1"``.
        autoload: declare the ``torch.backends`` entry point ``torch_npu = torch_npu:_autoload``
            (what the real wheel declares), so ``import torch`` autoloads the stub.
        generation: which real wheel the stub behaves like, ``"2.5"`` or ``"2.14"`` (default: the
            one ``version`` belongs to). ``"2.5"`` writes the 2.5.1 wheel's dist-info (``Name:
            torch-npu``, ``Requires-Dist: torch (==X+cpu)``, the ``torch.backends`` and
            ``torch_npu_run`` entry points); ``"2.14"`` the 2.14.0 wheel's (``Name: torch_npu``,
            ``Requires-Dist: torch==X.*``, plus ``[torch_dynamo_backends] npu, npugraph_ex,
            npugraphs``). The stub's import behaviour follows too (see its docstring).

    Returns:
        ``dest``.
    """
    generation = generation or default_generation(version)
    if generation not in GENERATIONS:
        raise ValueError(f"generation {generation!r} is not one of {GENERATIONS}")
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copytree(STUB_PACKAGE, dest / "torch_npu",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (dest / "torch_npu" / "_generation.py").write_text(f"GENERATION = {generation!r}\n", encoding="utf-8")
    info = dest / f"torch_npu-{version}.dist-info"
    info.mkdir()
    release = _torch_release(version)
    name, pin = (("torch_npu", f"torch=={release}.*") if generation == "2.14"
                 else ("torch-npu", f"torch (=={release}+cpu)"))
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nRequires-Dist: {pin}\n",
        encoding="utf-8")
    (info / "top_level.txt").write_text("torch_npu\n", encoding="utf-8")
    if autoload:
        points = "[console_scripts]\ntorch_npu_run = torch_npu.distributed.run:_main\n\n" \
                 "[torch.backends]\ntorch_npu = torch_npu:_autoload\n"
        if generation == "2.14":
            points += ("\n[torch_dynamo_backends]\nnpu = torch_npu.dynamo:_npu_backend_entrypoint\n"
                       "npugraph_ex = torch_npu.dynamo:_npugraph_ex_backend_entrypoint\n"
                       "npugraphs = torch_npu.dynamo:_npugraphs_backend_entrypoint\n")
        (info / "entry_points.txt").write_text(points, encoding="utf-8")
    return dest


def fake_env(*, site: Path | None = None, toolkit: Path | None = None, npu_smi: bool = False,
             event_log: Path | None = None, **extra: str) -> dict[str, str]:
    """A subprocess environment: the host's, minus Ascend settings, plus the chosen fakes.

    Args:
        site: directory from ``build_site`` to put first on PYTHONPATH, or None for no torch_npu.
        toolkit: value for ``ASCEND_TOOLKIT_HOME`` (e.g. ``TOOLKIT_HOME``), or None. The default
            path ``/usr/local/Ascend/ascend-toolkit/latest`` is still searched by the code under
            test; on a CPU-only test machine it does not exist.
        npu_smi: put the fake ``npu-smi`` first on PATH.
        event_log: a file for the stub's event log (``FAKE_NPU_EVENT_LOG``); also puts the
            ``import aurora`` hook (``import_hook/sitecustomize.py``) on PYTHONPATH.
        **extra: more variables (``FAKE_TORCH_NPU_MODE="libhccl"``, …).
    """
    env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED}
    hook = [str(IMPORT_HOOK_DIR)] if event_log is not None else []
    env["PYTHONPATH"] = os.pathsep.join([*([str(site)] if site else []), *hook, str(REPO_ROOT)])
    if event_log is not None:
        env["FAKE_NPU_EVENT_LOG"] = str(event_log)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    if toolkit is not None:
        env["ASCEND_TOOLKIT_HOME"] = str(toolkit)
    if npu_smi:
        env["PATH"] = os.pathsep.join([str(BIN_DIR), env.get("PATH", "")])
    env.update(extra)
    return env


def run_python(code: str | None = None, *, args: list[str] | None = None,
               env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``python -c code`` (or ``python *args``) with this interpreter in ``REPO_ROOT``."""
    argv = [sys.executable, *(["-c", code] if code is not None else []), *(args or [])]
    return subprocess.run(argv, cwd=REPO_ROOT, env=env if env is not None else fake_env(),
                          capture_output=True, text=True, timeout=timeout)
