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


DeviceUnavailableError.__module__ = "pytest_npu_parity.devices"  # printed as before the move


def _npu_status():
    from .npu.loading import npu_status  # safe: never raises, never breaks `import torch`

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
    from .machine import device_name as _name

    return _name(device)


# ---------------------------------------------------------------------------------------------
# One device per pytest-xdist worker
# ---------------------------------------------------------------------------------------------

_WORKER_ID = re.compile(r"^gw(\d+)$")


def xdist_worker_index(worker_id: str | None) -> int | None:
    """The index ``K`` of a pytest-xdist worker id ``gwK``; None for no worker (None, "" or "master").

    Raises:
        ValueError: an id of another form (names it).
    """
    if worker_id in (None, "", "master"):
        return None
    match = _WORKER_ID.match(str(worker_id))
    if not match:
        raise ValueError(f"pytest-xdist worker id {worker_id!r} is not of the form gwN")
    return int(match.group(1))


def parse_worker_devices(text: str | None, *, option: str = "--parity-worker-devices") -> tuple[int, ...] | None:
    """Parse a worker→device mapping: comma-separated device indices, worker ``K`` gets entry ``K mod n``.

    ``"0,2,4,6"`` → ``(0, 2, 4, 6)``; ``None`` or blank → None (no mapping: ``K mod device_count``).

    Raises:
        ValueError: an entry that is not a non-negative integer (quotes the option and the value).
    """
    if text is None or not str(text).strip():
        return None
    indices = []
    for part in str(text).split(","):
        part = part.strip()
        if not part.isdigit():
            raise ValueError(f"{option}={text!r}: {part!r} is not a device index; give comma-separated "
                             "indices such as 0,2,4,6")
        indices.append(int(part))
    return tuple(indices)


def pinned_device(kind: str, index: int | None, worker_index: int | None, device_count: int,
                  mapping: tuple[int, ...] | None = None, *,
                  option: str = "--parity-worker-devices") -> str:
    """The device spec a pytest-xdist worker runs on (pure: no device is touched).

    Rules: ``cpu`` stays ``cpu``; an explicit index (``npu:3``) is respected by every worker; otherwise
    worker ``K`` (``gwK``; a run without xdist counts as worker 0) gets ``mapping[K mod len(mapping)]``
    or, without a mapping, ``K mod device_count``.

    Args:
        kind: the resolved device type: ``cpu``, ``cuda`` or ``npu`` (``auto`` already resolved).
        index: the index given in the spec (``npu:3`` → 3), or None.
        worker_index: ``K`` of ``gwK`` (``xdist_worker_index``), or None without xdist.
        device_count: visible devices of ``kind`` (≥ 1 for an accelerator).
        mapping: ``parse_worker_devices`` result, or None.

    Returns:
        ``"cpu"`` or ``"<kind>:<index>"``.

    Raises:
        ValueError: a mapping together with an explicit index, an empty mapping, a mapped index
            beyond the visible devices, or no visible device.
    """
    if kind == "cpu":
        return "cpu"
    if index is not None:
        if mapping:
            raise ValueError(f"{option} cannot be combined with an explicit device index ({kind}:{index}); "
                             f"give --parity-device={kind} to let the mapping choose")
        return f"{kind}:{index}"
    if device_count < 1:
        raise ValueError(f"no {kind} device is visible to pin pytest-xdist workers to")
    worker = worker_index or 0
    if mapping is not None:
        if not mapping:
            raise ValueError(f"{option} is empty")
        beyond = [i for i in mapping if i >= device_count]
        if beyond:
            raise ValueError(f"{option}={','.join(map(str, mapping))}: {kind} index {beyond[0]} is not visible "
                             f"(only {device_count} {kind} device(s), indices 0..{device_count - 1})")
        return f"{kind}:{mapping[worker % len(mapping)]}"
    return f"{kind}:{worker % device_count}"


def _device_count(kind: str) -> int:
    if kind == "cuda":
        return torch.cuda.device_count()
    if kind == "npu":
        return _npu_status().device_count
    return 1


def resolve_worker_target(spec: str, worker_id: str | None = None, mapping: str | None = None, *,
                          option: str = "--parity-device",
                          mapping_option: str = "--parity-worker-devices") -> torch.device:
    """``resolve_target`` for one pytest-xdist worker: the device it is pinned to (see ``pinned_device``).

    Args:
        spec: the ``--parity-device`` value (``auto``, ``npu``, ``npu:N``, ``cuda``, ``cuda:N``, ``cpu``).
        worker_id: ``gwK`` inside a pytest-xdist worker, else None.
        mapping: the ``--parity-worker-devices`` value (``"0,2,4,6"``) or None.

    Raises:
        ValueError: a bad spec, worker id or mapping (the message names the option).
        DeviceUnavailableError: as ``resolve_target``.
    """
    target = resolve_target(spec, option=option)
    match = _SPEC.match(spec.strip().lower())
    index = int(match.group(2)) if match and match.group(2) else None
    indices = parse_worker_devices(mapping, option=mapping_option)
    if target.type == "cpu" or (index is None and indices is None and xdist_worker_index(worker_id) is None):
        return target
    pinned = pinned_device(target.type, index, xdist_worker_index(worker_id), _device_count(target.type),
                           indices, option=mapping_option)
    return resolve_target(pinned, option=option)
