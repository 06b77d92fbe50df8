"""The audit's process-wide state: the logical device of each tracked CPU tensor (``_LOGICAL``) and
whether the plugin's own work is running inside an audited run (``_QUIET``, :func:`not_audited`).

Both live here only: runtime modules (the shared random stream, layer capture, training) import
:func:`not_audited` from here (through ``pytest_npu_parity.audit``), the tracker reads both.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import torch


class _DeviceTable:
    """Tensor identity -> logical device, holding no tensor alive (``weakref``), like
    ``torch.utils.weak.WeakIdKeyDictionary`` but without allocating a reference per lookup (the
    lookup runs for every tensor of every op)."""

    def __init__(self) -> None:
        self._data: dict[int, tuple[weakref.ref, torch.device]] = {}

    def get(self, t: torch.Tensor, default: torch.device) -> torch.device:
        entry = self._data.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry[1]
        return default

    def set(self, t: torch.Tensor, device: torch.device) -> None:
        key = id(t)
        entry = self._data.get(key)
        if entry is not None and entry[0]() is t:
            self._data[key] = (entry[0], device)
            return
        data = self._data

        def forget(ref: weakref.ref, key: int = key) -> None:
            current = data.get(key)
            if current is not None and current[0] is ref:
                del data[key]

        data[key] = (weakref.ref(t, forget), device)

    def pop(self, t: torch.Tensor) -> None:
        entry = self._data.get(id(t))
        if entry is not None and entry[0]() is t:
            del self._data[id(t)]

    def __len__(self) -> int:
        return len(self._data)


#: > 0 while the plugin does its own work inside an audited run (:func:`not_audited`).
_QUIET = [0]


@contextlib.contextmanager
def not_audited() -> Iterator[None]:
    """Inside the block no audit records an event, while tensors stay tracked (logical mode: a
    tensor moved to the device inside the block is on the device after it).

    For the plugin's own work inside an audited run, which is not the model's: the shared random
    stream's CPU draws and their copy to the device (``rng.same_randomness``: a dropout mask is
    drawn on the host so that both sides see the same numbers; unaudited, the model would draw it
    on the device), and a training step's gradient clipping and optimizer step
    (``runner.ParityCase.train_step``). Nests; not thread-safe (like the audit itself).
    """
    _QUIET[0] += 1
    try:
        yield
    finally:
        _QUIET[0] -= 1


#: Which logical device a CPU tensor lives on (logical mode). Process-wide, like real device
#: memory: a tensor cached by one audited run (e.g. a patched ``resample`` cache) is still "on the
#: device" in the next. Absent means on the host. Weak, so it never keeps a tensor alive.
_LOGICAL = _DeviceTable()
