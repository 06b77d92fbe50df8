"""Devices as the audit sees them: parsing a target, whether it exists here, the logical index
rule, and the tensors of an op's arguments.
"""
from __future__ import annotations

from typing import Any

import torch

from .events import DEFAULT_LOGICAL_TARGET

_HOST = torch.device("cpu")
_FP64 = (torch.float64, torch.complex128)


def _parse_device(spec: Any, what: str) -> torch.device:
    if isinstance(spec, torch.device):
        return spec
    try:
        return torch.device(spec)
    except (RuntimeError, TypeError, ValueError) as exc:
        hint = ""
        if isinstance(spec, str) and spec.split(":")[0].strip().lower() == "npu":
            hint = (" — torch_npu is not loaded, so 'npu' is not a device type here; audit a logical "
                    f"'{DEFAULT_LOGICAL_TARGET}' instead (the device-propagation rules are the same)")
        raise ValueError(f"{what}: {spec!r} is not a device ({exc}){hint}") from exc


def _device_available(device: torch.device) -> bool:
    if device.type == "meta":
        return True
    backend = getattr(torch, device.type, None)
    is_available = getattr(backend, "is_available", None)
    if is_available is None:
        return False
    try:
        if not is_available():
            return False
        count = getattr(backend, "device_count", None)
        return device.index is None or count is None or device.index < count()
    except Exception:  # noqa: BLE001 - a backend that cannot even answer is not available
        return False


def _with_index(device: torch.device) -> torch.device:
    """Logical mode: an accelerator device without index means index 0 (default current device)."""
    if device.type != "cpu" and device.index is None:
        return torch.device(device.type, 0)
    return device


#: The autograd node whose backward runs now, None outside a backward (torch >= 2.0, 2.5.1 checked).
_current_autograd_node = getattr(torch._C, "_current_autograd_node", lambda: None)


def _main_dtype(tensors: list) -> torch.dtype | None:
    """The dtype of the first tensor that is not 0-dim (else of the first), or None."""
    for t in tensors:
        if t.dim() > 0:
            return t.dtype
    return tensors[0].dtype if tensors else None


def _tensors(obj: Any, out: list | None = None) -> list[torch.Tensor]:
    """Tensors in an op's arguments or results: tensors, and tensors inside lists/tuples (ATen's
    ``Tensor[]``/``Tensor?[]``) or dict values (kwargs), one level deep as in ATen schemas."""
    if out is None:
        out = []
    if isinstance(obj, torch.Tensor):
        out.append(obj)
        return out
    if isinstance(obj, dict):
        obj = obj.values()
    elif not isinstance(obj, (list, tuple)):
        return out
    for item in obj:
        if isinstance(item, torch.Tensor):
            out.append(item)
        elif isinstance(item, (list, tuple)):
            out.extend(t for t in item if isinstance(t, torch.Tensor))
    return out
