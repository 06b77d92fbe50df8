"""Test stand-in for ``torch_npu`` (Ascend Extension for PyTorch); never touches hardware.

Reproduces the import behaviour of the real package that the NPU detection must survive, chosen
by ``FAKE_TORCH_NPU_MODE``:

* ``ok`` (default) — registers ``npu`` as torch's PrivateUse1 device and ``torch.npu`` (see
  ``torch_npu/npu.py``); tensors cannot actually be allocated on it, so op probes fail there.
* ``libhccl`` / ``libascendcl`` — ``ImportError: libhccl.so: cannot open shared object file``
  (CANN's ``set_env.sh`` not sourced; docs/explanation/findings.md, "Devices without hardware").
* ``two_accelerators_cuda`` / ``two_accelerators_npu`` — the RuntimeError torch_npu raises when
  another accelerator (or a second torch_npu registration) is already present.
* ``glibcxx`` — the OSError of a torch_npu built against another toolchain (seed §10.6).

``FAKE_NPU_HCCL=gloo`` registers a ``torch.distributed`` backend named ``hccl`` (the real wheel
registers HCCL on import) that is gloo underneath, so a process group can be initialized on the
CPU; by default no ``hccl`` backend exists.

Like the real wheels, it switches ``TORCH_DEVICE_BACKEND_AUTOLOAD`` off, imports torch, and only then
fails, leaving the variable at ``0``; ``_autoload`` restores it. ``_generation.GENERATION`` (written by
``fake_env.build_site``) picks which wheel it behaves like where they differ (``ascend_release``'s
docstring has the citations):

* ``"2.5"`` (torch_npu 2.5.1 ``__init__``): the libhccl/libascendcl ImportError carries "Please check
  that the cann package is installed. Please run 'source set_env.sh' …"; "npu and npu" is raised
  for a second registration; a direct ``import torch_npu`` leaves the switch at ``0``.
* ``"2.14"`` (torch_npu 2.14.0 ``__init__``): the bare ImportError (``torch_npu/npu/utils.py``
  imports ``torch_npu._C`` before ``_check_npu_import`` could add to it); ``_check_device_conflict``
  accepts ``npu``, so ``two_accelerators_npu`` does not raise; a successful import ends with
  ``_autoload()``.

The package version and its torch pin come from the dist-info that ``fake_env.build_site`` writes.
"""
import importlib.metadata
import os

# As the real wheel does: disable autoloading before `import torch` (a circular import otherwise).
ORG_AUTOLOAD = os.getenv("TORCH_DEVICE_BACKEND_AUTOLOAD", "1")
os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"

import torch  # noqa: E402

try:
    __version__ = importlib.metadata.version("torch_npu")
except importlib.metadata.PackageNotFoundError:
    __version__ = "0.0.0"

try:
    from ._generation import GENERATION
except ImportError:  # the stub used in place, not through build_site
    GENERATION = "2.5"

_MODE = os.environ.get("FAKE_TORCH_NPU_MODE", "ok")
# torch_npu.utils._error_code.pta_error(ErrCode.NOT_FOUND), 2.5.1 wheel
_PTA_NOT_FOUND = "\n[ERROR] 2026-01-01-00:00:00 (PID:1, Device:-1, RankID:-1) ERR00008 PTA resource not found"


def _missing_cann_lib(lib):
    message = f"{lib}: cannot open shared object file: No such file or directory"
    if GENERATION == "2.5":  # torch_npu 2.5.1 __init__: the try around `import torch_npu.npu`
        what = "runtime" if lib == "libascendcl.so" else "cann"
        message += (f". Please check that the {what} package is installed. Please run 'source set_env.sh' "
                    f"in the CANN installation path.{_PTA_NOT_FOUND}")
    return ImportError(message)


if _MODE == "libhccl":
    raise _missing_cann_lib("libhccl.so")
if _MODE == "libascendcl":
    raise _missing_cann_lib("libascendcl.so")
if _MODE == "glibcxx":
    raise OSError("/usr/lib/aarch64-linux-gnu/libstdc++.so.6: version `GLIBCXX_3.4.29' not found "
                  "(required by site-packages/torch_npu/lib/libtorch_npu.so)")

if _MODE.startswith("two_accelerators") and not (_MODE.endswith("npu") and GENERATION == "2.14"):
    _other = "npu" if _MODE.endswith("npu") else "cuda"
    raise RuntimeError(
        f"Two accelerators cannot be used at the same time in PyTorch: npu and {_other}. You can "
        f"install the cpu version of PyTorch to use your npu device, or use the {_other} device "
        f"with 'export TORCH_DEVICE_BACKEND_AUTOLOAD=0'."
    )
if _MODE not in ("ok", "two_accelerators_npu"):
    raise RuntimeError(f"FAKE_TORCH_NPU_MODE={_MODE!r} is not a mode of the torch_npu stub")

from . import npu  # noqa: E402

torch.utils.rename_privateuse1_backend("npu")
torch._register_device_module("npu", npu)

if os.environ.get("FAKE_NPU_HCCL") == "gloo":
    import torch.distributed as _dist

    def _hccl_as_gloo(store, rank, size, timeout):
        return _dist.ProcessGroupGloo(store, rank, size, timeout)

    _dist.Backend.register_backend("hccl", _hccl_as_gloo, devices=["npu", "cpu"])


def npu_fusion_attention(*args, **kwargs):
    """The real wheel's fused attention op; transformers' ``integrations/npu_flash_attention.py`` imports
    it by name when an NPU is available (4.57), which every transformers model import reaches."""
    raise RuntimeError("npu_fusion_attention: the torch_npu stub has no NPU kernels")


def _autoload():
    """Entry point of group ``torch.backends``: importing the package is the whole job; like the
    real wheel it restores the autoload switch for subprocesses."""
    os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = ORG_AUTOLOAD


if GENERATION == "2.14":  # torch_npu 2.14.0 __init__ ends with `_autoload()`
    _autoload()
