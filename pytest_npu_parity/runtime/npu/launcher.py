"""The NPU compat layer: what the Ascend guide's launcher does before ``import aurora``.

``register_transfer_to_npu``, ``set_npu_options``, ``bind_device``, and ``launch``, which runs those
three in the launcher's order and keeps its record (``_LAUNCHED``); ``precision_flags``,
``fp16_warning`` and ``dist_backend_for`` (seed ``000_76a3155d974abf2f.txt``, §4.2 launcher steps
①–②, §7.3 HCCL, §9.4 compile mode).
"""
from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import re
import sys
from typing import TYPE_CHECKING, Any, Iterable

from .loading import _STATUS_LOCK, import_torch, npu_status

if TYPE_CHECKING:  # torch is imported lazily at run time
    import torch

logger = logging.getLogger("pytest_npu_parity.npu")  # the module's logger name before the split


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


LaunchOrderError.__module__ = "pytest_npu_parity.npu"  # printed as before the move


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
    from ..recipes import precision_flags as _flags

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
