"""Stand-in for ``torch_npu.npu`` / ``torch.npu``: device count, names, memory and flags.

``FAKE_NPU_DEVICE_COUNT`` (default 1) and ``FAKE_NPU_NAME`` (default ``Ascend910B3``) shape it.
Calls to ``set_device`` and ``set_compile_mode`` are recorded in ``CALLS`` for the tests (and in the
event log, see ``torch_npu._events``); ``is_jit_compile_false`` answers what ``set_compile_mode`` set
(the real default is JIT compilation on).
"""
import os
import types

from torch_npu import _events

CALLS = []
_COUNT = int(os.environ.get("FAKE_NPU_DEVICE_COUNT", "1"))
_NAME = os.environ.get("FAKE_NPU_NAME", "Ascend910B3")

# torch_npu defaults (docs/explanation/findings.md): matmul HF32 off, conv HF32 on.
matmul = types.SimpleNamespace(allow_hf32=False)
conv = types.SimpleNamespace(allow_hf32=True)


def is_available():
    return _COUNT > 0


def device_count():
    return _COUNT


def get_device_name(index=0):
    return _NAME


def current_device():
    return 0


def set_device(index):
    CALLS.append(("set_device", index))
    _events.record("set_device", index=index)


def mem_get_info(index=0):
    """(free, total) bytes, like torch.npu.mem_get_info."""
    return 60 * 2**30, 64 * 2**30


def synchronize(device=None):
    return None


_JIT_COMPILE = [True]


def set_compile_mode(jit_compile=True):
    CALLS.append(("set_compile_mode", jit_compile))
    _JIT_COMPILE[0] = bool(jit_compile)
    _events.record("set_compile_mode", jit_compile=bool(jit_compile))


def is_jit_compile_false():
    return not _JIT_COMPILE[0]


class Event:
    """``torch.npu.Event`` (DeepSpeed's NPU accelerator annotates its timers with it at import)."""

    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self.enable_timing = enable_timing

    def record(self, stream=None):
        return None

    def synchronize(self):
        return None


class Stream:
    """``torch.npu.Stream`` (DeepSpeed's ZeRO code annotates with it at import)."""

    def __init__(self, device=None, priority=0):
        self.device = device

    def synchronize(self):
        return None
