"""Target devices: parse ``--parity-device``, refuse absent devices, name devices for reports, and pin
each pytest-xdist worker to its own device (``pinned_device``, ``resolve_worker_target``).

``auto`` picks npu > cuda > cpu. An explicitly requested device that is absent raises
``DeviceUnavailableError`` with one sentence saying what is missing and how to fix it — never a
quiet CPU fallback, which would turn a parity run into a CPU-vs-CPU pass.
"""
from __future__ import annotations

import re

import torch

_SPEC = re.compile(r"^(auto|cpu|cuda|npu)(?::(\d+))?$")


class DeviceUnavailableError(RuntimeError):
    """The requested target device does not exist on this machine; the message says why and the fix."""


def _npu_status():
    from .npu import npu_status  # safe: never raises, never breaks `import torch`

    return npu_status()


def _cuda_reason() -> str:
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build — install a CUDA build of torch"
    return ("no CUDA device is visible (torch.cuda.is_available() is False) — check the driver "
            "with nvidia-smi and CUDA_VISIBLE_DEVICES")


def resolve_target(spec: str, *, option: str = "--parity-device") -> torch.device:
    """Turn a device spec into a ``torch.device`` that exists here.

    Args:
        spec: ``auto``, ``cpu``, ``cuda``, ``cuda:N``, ``npu`` or ``npu:N`` (case-insensitive).
        option: the option name used in error messages.

    Returns:
        The device; ``npu``/``cuda`` without index mean index 0.

    Raises:
        ValueError: the spec is not of that form.
        DeviceUnavailableError: the device type is absent, torch_npu cannot be loaded, or the index
            is out of range; the message names the option and the fix.
    """
    match = _SPEC.match(spec.strip().lower())
    if not match:
        raise ValueError(f"{option}={spec!r} is not a device: use auto, cpu, cuda, cuda:N, npu or npu:N")
    kind, index = match.group(1), int(match.group(2) or 0)
    if kind == "auto":
        if match.group(2):
            raise ValueError(f"{option}={spec!r}: 'auto' takes no index")
        if _npu_status().available:
            return torch.device("npu", 0)
        if torch.cuda.is_available():
            return torch.device("cuda", 0)
        return torch.device("cpu")
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailableError(f"{option}={spec}: {_cuda_reason()}")
        count = torch.cuda.device_count()
    else:
        status = _npu_status()
        if not status.available:
            raise DeviceUnavailableError(f"{option}={spec}: {status.reason}")
        count = status.device_count
    if index >= count:
        raise DeviceUnavailableError(
            f"{option}={spec}: only {count} {kind} device(s) visible (indices 0..{count - 1})"
        )
    return torch.device(kind, index)


def device_name(device: torch.device) -> str:
    """A human name for ``device``: the CPU model, e.g. "NVIDIA H200", or the Ascend chip name
    (``provenance.device_name``; never raises)."""
    from .provenance import device_name as _name

    return _name(device)
