"""The tracker: the classification of ops shared by both modes (op facts cached per
``OpOverload``, :class:`_Tracker`), the marks and copies of logical mode, the handlers of
Python-level calls in logical mode and the dispatch and function modes that feed the tracker.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map
from torch.utils._python_dispatch import TorchDispatchMode

from .devices import _FP64, _HOST, _current_autograd_node, _main_dtype, _tensors, _with_index
from .events import _COPY_NOTE, AuditRecord
from .state import _LOGICAL, _QUIET

# ------------------------------------------------------------------------------------------------
# Op facts (cached per OpOverload)
# ------------------------------------------------------------------------------------------------

_COPY_OPS = {"aten::copy_", "aten::copy", "aten::_to_copy", "aten::_copy_from", "aten::_copy_from_and_resize"}
_INDEX_OPS = {"aten::index", "aten::_unsafe_index", "aten::index_put", "aten::index_put_",
              "aten::_index_put_impl_", "aten::_unsafe_index_put"}
# Ops that read or relabel memory rather than compute: never reported as CPU ops.
_NOT_COMPUTE = {"aten::detach", "aten::detach_", "aten::alias", "aten::lift_fresh", "aten::lift_fresh_copy",
                "aten::_local_scalar_dense", "aten::set_", "aten::_has_compatible_shallow_copy_type"}
_SYNC_TAGS = tuple(getattr(torch.Tag, name) for name in ("data_dependent_output", "dynamic_output_shape")
                   if hasattr(torch.Tag, name))


@dataclass(frozen=True)
class _OpInfo:
    name: str        # aten::add.Tensor
    packet: str      # aten::add
    is_view: bool
    is_copy: bool
    is_index: bool
    syncs: bool
    compute: bool


_op_cache: dict[Any, _OpInfo] = {}


def _op_info(func: Any) -> _OpInfo:
    info = _op_cache.get(func)
    if info is None:
        schema = func._schema
        packet = schema.name if "::" in schema.name else f"aten::{schema.name}"
        name = packet + (f".{schema.overload_name}" if schema.overload_name else "")
        is_view = getattr(func, "is_view", None)
        if is_view is None:
            is_view = any(a.alias_info is not None and not a.alias_info.is_write for a in schema.arguments)
        tags = getattr(func, "tags", ())
        is_copy = packet in _COPY_OPS
        is_index = packet in _INDEX_OPS
        syncs = not is_index and any(t in tags for t in _SYNC_TAGS)
        info = _OpInfo(name, packet, bool(is_view), is_copy, is_index, syncs,
                       not (is_view or is_copy or packet in _NOT_COMPUTE))
        _op_cache[func] = info
    return info


# ------------------------------------------------------------------------------------------------
# The tracker: classification shared by both modes, marks and copies for logical mode
# ------------------------------------------------------------------------------------------------

class _Tracker:
    def __init__(self, target: torch.device, logical: bool, unsupported: frozenset[str], record: AuditRecord):
        self.target = target
        self.logical = logical
        self.unsupported = unsupported
        self.record = record
        self.call_devices: list[torch.device | None] = []  # logical mode: device of the current Python-level call
        self.suppress = 0  # > 0 while the tracker runs its own ops (copies of .to/.cpu): no events

    # -- devices ------------------------------------------------------------------------------
    def device_of(self, t: torch.Tensor) -> torch.device:
        if self.logical:
            return _LOGICAL.get(t, _HOST)
        return t.device

    def resolve(self, spec: Any) -> torch.device:
        """A device argument as the run means it (logical mode: ints are target-type indices)."""
        if isinstance(spec, int) and not isinstance(spec, bool):
            return torch.device(self.target.type, spec)
        device = spec if isinstance(spec, torch.device) else torch.device(spec)
        return _with_index(device)

    @staticmethod
    def mark(t: torch.Tensor, device: torch.device) -> None:
        if device.type == "cpu":
            _LOGICAL.pop(t)
        else:
            _LOGICAL.set(t, device)

    def common_device(self, devices: list[torch.device]) -> torch.device:
        """Where an op's output lives: the target if an input is there, else the first accelerator
        device among the inputs, else the host."""
        accel = [d for d in devices if d.type != "cpu"]
        if not accel:
            return _HOST
        return self.target if self.target in accel else accel[0]

    # -- events -------------------------------------------------------------------------------
    @property
    def quiet(self) -> bool:
        """No events now: the tracker's own copies, or the plugin's own work (:func:`not_audited`)."""
        return bool(self.suppress or _QUIET[0])

    def add(self, kind: str, op: str, devices: Iterable[torch.device], dtype: torch.dtype | None = None,
            note: str = "") -> None:
        if not self.quiet:
            self.record.add(kind, op, devices, dtype, note)

    def copy_event(self, op: str, src: torch.device, dst: torch.device, dtype: torch.dtype,
                   note: str = "") -> None:
        if src == dst:
            pass
        elif src.type == "cpu":
            self.add("h2d", op, (src, dst), dtype, note)
        elif dst.type == "cpu":
            self.add("d2h", op, (src, dst), dtype, note)
        else:
            self.add("mixed_device", op, (src, dst), dtype, note or _COPY_NOTE)
        if dst.type != "cpu" and dtype in _FP64:
            self.add("fp64", op, (dst,), dtype)

    # -- dispatch -----------------------------------------------------------------------------
    def on_dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        __tracebackhide__ = True  # pytest shows the model's frames, not the audit's
        if self.logical and torch._C._is_torch_function_mode_enabled():
            # reached without passing the function mode (e.g. from C++): keep our own tensor
            # accesses (.dim(), .dtype) away from it
            with torch._C.DisableTorchFunction():
                return self._dispatch(func, args, kwargs)
        return self._dispatch(func, args, kwargs)

    def _dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        __tracebackhide__ = True  # pytest shows the model's frames, not the audit's
        info = _op_info(func)
        explicit = None
        ins = _tensors(args)
        _tensors(kwargs, ins)
        in_devs = [self.device_of(t) for t in ins]
        if self.logical and kwargs.get("device") is not None:
            device = self.resolve(kwargs["device"])
            if device.type != "cpu":  # run it on the CPU, the result lives on `device`
                kwargs = dict(kwargs, device=_HOST)
                if kwargs.get("pin_memory"):
                    kwargs["pin_memory"] = False
                explicit = device
            elif _current_autograd_node() is not None:
                # A backward formula (grad.new_zeros(sizes, self.options()), grad.to(self.options()))
                # passes the tensors' *real* device, the CPU for every tensor in logical mode: it means
                # "where the related tensors are", the inputs' device, or the target for a factory.
                related = self.common_device(in_devs) if ins else self.target
                explicit = related if related.type != "cpu" else None
        quiet = self.quiet
        if not quiet:  # before the call: a real op may raise on what it is recorded for
            self._before(info, args, kwargs, explicit, ins, in_devs)
        out = func(*args, **kwargs)
        outs = _tensors(out)
        if self.logical:
            out_dev = self._output_device(kwargs, explicit, ins, in_devs)
            out_devs = []
            for o in outs:
                if any(o is t for t in ins):  # in-place / out=: keeps its device
                    out_devs.append(self.device_of(o))
                else:
                    self.mark(o, out_dev)
                    out_devs.append(out_dev)
        else:
            out_devs = [o.device for o in outs]
        if not quiet:
            self._after(info, args, ins, in_devs, outs, out_devs)
        return out

    def _output_device(self, kwargs: dict, explicit: torch.device | None, ins: list,
                       in_devs: list) -> torch.device:
        if explicit is not None:
            return explicit
        if not ins:  # a factory: inside a call on the target (rewritten or composite) it is on the target
            return (self.call_devices[-1] if self.call_devices else None) or _HOST
        if kwargs.get("device") is not None:  # explicit host device with tensor inputs, e.g. _to_copy(cpu)
            return _HOST
        return self.common_device(in_devs)

    def _before(self, info: _OpInfo, args: tuple, kwargs: dict, explicit: torch.device | None, ins: list,
                in_devs: list) -> None:
        if info.is_copy:
            if info.packet == "aten::_to_copy" and ins:  # _to_copy(src, dtype=, device=)
                device = kwargs.get("device")
                if explicit is not None:
                    dst = explicit
                elif device is None:
                    dst = in_devs[0]
                else:
                    dst = self.resolve(device) if self.logical else torch.device(device)
                self.copy_event(info.name, in_devs[0], dst, kwargs.get("dtype") or ins[0].dtype)
            elif len(ins) >= 2:  # copy_(self, src): src -> self
                self.copy_event(info.name, in_devs[1], in_devs[0], ins[0].dtype)
            return
        pairs = list(zip(ins, in_devs))
        sync = info.syncs and any(d.type != "cpu" for d in in_devs)
        if info.is_index and ins:
            self_dev = in_devs[0]
            indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
            for idx in indices:
                if not isinstance(idx, torch.Tensor) or self_dev.type == "cpu":
                    continue
                if self.device_of(idx).type == "cpu" and idx.dim() > 0:  # PyTorch copies it over
                    self.add("h2d", info.name, (_HOST, self_dev), idx.dtype,
                             "CPU index tensor copied to the device")
                    pairs = [(t, d) for t, d in pairs if t is not idx]
                if idx.dtype in (torch.bool, torch.uint8):  # boolean mask: data-dependent shape
                    sync = True
        distinct = {d for t, d in pairs if d.type != "cpu" or t.dim() > 0}
        if len(distinct) > 1:
            order = sorted(distinct, key=lambda d: (d != self.target, d.type == "cpu", str(d)))
            # the dtype of the first tensor off the op's main device: the stray one
            stray = next((t for t, d in pairs if d == order[-1] and (d.type != "cpu" or t.dim() > 0)), None)
            self.add("mixed_device", info.name, order, stray.dtype if stray is not None else None)
        declared = bool(self.unsupported) and (info.name in self.unsupported or info.packet in self.unsupported)
        if not (sync or declared):
            return
        accel = sorted({d for d in in_devs if d.type != "cpu"}, key=str)
        if sync:
            self.add("host_sync", info.name, accel)
        if accel and declared:
            self.add("cpu_fallback", info.name, accel, note="declared unsupported on the target")

    def _after(self, info: _OpInfo, args: tuple, ins: list, in_devs: list, outs: list, out_devs: list) -> None:
        if not info.compute:  # copies are classified before the call; views and reads add nothing
            return
        tensors, devices = ins + outs, in_devs + out_devs
        if all(d.type == "cpu" for d in devices):
            if any(t.dim() > 0 for t in tensors):
                self.add("cpu_fallback", info.name, (_HOST,), _main_dtype(outs or tensors),
                         note=f"ran on the CPU, target {self.target}")
            return
        fp64 = [(t, d) for t, d in zip(tensors, devices) if t.dtype in _FP64 and d.type != "cpu"]
        if fp64:
            self.add("fp64", info.name, sorted({d for _, d in fp64}, key=str), fp64[0][0].dtype)
        if ins and not info.syncs and all(d.type != "cpu" for d in in_devs) \
                and any(d.type == "cpu" and t.dim() > 0 for t, d in zip(outs, out_devs)):
            self.add("cpu_fallback", info.name, sorted(set(in_devs), key=str) + [_HOST], _main_dtype(outs),
                     note="target inputs, CPU output")

    # -- Python level (logical mode) -------------------------------------------------------------
    def move(self, t: torch.Tensor, dst: torch.device | None, dtype: torch.dtype | None, op: str, *,
             copy: bool = False, memory_format: torch.memory_format | None = None,
             non_blocking: bool = False) -> torch.Tensor:
        """``t.to(dst, dtype)`` between logical devices: data stays on the CPU, the mark moves."""
        __tracebackhide__ = True
        src = self.device_of(t)
        dst = src if dst is None else dst
        extra = {} if memory_format is None else {"memory_format": memory_format}
        if dst == src:
            return t.to(dtype=dtype or t.dtype, non_blocking=non_blocking, copy=copy, **extra)
        self.suppress += 1
        try:
            out = t.to(dtype=dtype or t.dtype, copy=True, **extra)
        finally:
            self.suppress -= 1
        self.mark(out, dst)
        self.copy_event(op, src, dst, out.dtype)
        return out

    def on_function(self, func: Any, args: tuple, kwargs: dict) -> Any:
        __tracebackhide__ = True  # pytest shows the model's frames, not the audit's
        handler = _SPECIAL.get(func)
        if handler is None and type(func).__name__ == "method-wrapper":
            handler = _SPECIAL.get(func.__self__)
        if handler is not None:
            return handler(self, func, args, kwargs)
        rewritten = None
        if kwargs.get("device") is not None:
            device = self.resolve(kwargs["device"])
            if device.type != "cpu":
                kwargs = dict(kwargs, device=_HOST)
                if kwargs.get("pin_memory"):
                    kwargs["pin_memory"] = False
                rewritten = device
                call_device = device
            else:
                call_device = _HOST
        else:
            ins = _tensors(args)
            _tensors(kwargs, ins)
            call_device = self.common_device([self.device_of(t) for t in ins]) if ins else None
        self.call_devices.append(call_device)
        try:
            out = func(*args, **kwargs)
        finally:
            self.call_devices.pop()
        if rewritten is not None:
            out = self._adopt(out, rewritten, args, kwargs, func)
        return out

    def _adopt(self, out: Any, device: torch.device, args: tuple, kwargs: dict, func: Any) -> Any:
        """Outputs of a call that asked for ``device=<accelerator>`` live there."""
        inputs = _tensors(args)
        _tensors(kwargs, inputs)
        name = _api_name(func)

        def adopt(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            if self.device_of(t) == device:
                return t
            src = None
            if any(t is i for i in inputs):  # e.g. torch.as_tensor(host_tensor, device=...): a copy
                src = self.device_of(t)
                self.suppress += 1
                try:
                    t = t.clone()
                finally:
                    self.suppress -= 1
            self.mark(t, device)
            if src is not None:
                self.copy_event(name, src, device, t.dtype)
            elif t.dtype in _FP64:
                self.add("fp64", name, (device,), t.dtype)
            return t

        return tree_map(adopt, out)


def _api_name(func: Any) -> str:
    resolve = getattr(torch.overrides, "resolve_name", None)
    name = resolve(func) if resolve is not None else None
    name = name or getattr(func, "__qualname__", None) or repr(func)
    return name.removeprefix("torch.") if name.startswith("torch.Tensor.") else name


# -- handlers of Python-level calls in logical mode ---------------------------------------------

def _h_device(tr: _Tracker, func, args, kwargs):
    return tr.device_of(args[0])


def _h_is_cuda(tr: _Tracker, func, args, kwargs):
    return tr.device_of(args[0]).type == "cuda"


def _h_is_cpu(tr: _Tracker, func, args, kwargs):
    return tr.device_of(args[0]).type == "cpu"


def _h_get_device(tr: _Tracker, func, args, kwargs):
    device = tr.device_of(args[0])
    return -1 if device.type == "cpu" else device.index


def _h_data(tr: _Tracker, func, args, kwargs):
    out = func(*args, **kwargs)
    tr.mark(out, tr.device_of(args[0]))
    return out


def _h_to(tr: _Tracker, func, args, kwargs):
    __tracebackhide__ = True
    t, pos = args[0], list(args[1:])
    kwargs = dict(kwargs)
    device = dtype = None
    other = pos.pop(0) if pos and isinstance(pos[0], torch.Tensor) else kwargs.pop("other", None)
    if other is not None:
        device, dtype = tr.device_of(other), other.dtype
    else:
        if pos and not isinstance(pos[0], (torch.dtype, bool)):
            spec = pos.pop(0)
            device = None if spec is None else tr.resolve(spec)
        if pos and isinstance(pos[0], torch.dtype):
            dtype = pos.pop(0)
        if kwargs.get("device") is not None:
            device = tr.resolve(kwargs["device"])
        dtype = kwargs.get("dtype", dtype)
    non_blocking = bool(pos.pop(0)) if pos else bool(kwargs.get("non_blocking", False))
    copy = bool(pos.pop(0)) if pos else bool(kwargs.get("copy", False))
    return tr.move(t, device, dtype, "Tensor.to", copy=copy, memory_format=kwargs.get("memory_format"),
                   non_blocking=non_blocking)


def _h_cuda(tr: _Tracker, func, args, kwargs):
    __tracebackhide__ = True
    spec = args[1] if len(args) > 1 else kwargs.get("device")
    if spec is None:
        device = torch.device("cuda", 0)
    elif isinstance(spec, int) and not isinstance(spec, bool):
        device = torch.device("cuda", spec)
    else:
        device = _with_index(torch.device(spec))
        if device.type != "cuda":
            raise RuntimeError(f"Invalid device, must be cuda device (got {device})")
    return tr.move(args[0], device, None, "Tensor.cuda", memory_format=kwargs.get("memory_format"))


def _h_npu(tr: _Tracker, func, args, kwargs):
    __tracebackhide__ = True
    spec = args[1] if len(args) > 1 else kwargs.get("device")
    index = spec if isinstance(spec, int) else (0 if spec is None else _with_index(torch.device(spec)).index)
    return tr.move(args[0], torch.device("npu", index), None, "Tensor.npu")


def _h_cpu(tr: _Tracker, func, args, kwargs):
    __tracebackhide__ = True
    return tr.move(args[0], _HOST, None, "Tensor.cpu", memory_format=kwargs.get("memory_format"))


def _reads_host(api: str, note: str = ""):
    def handler(tr: _Tracker, func, args, kwargs):
        __tracebackhide__ = True
        device = tr.device_of(args[0])
        if device.type != "cpu":
            tr.add("d2h", api, (device, _HOST), args[0].dtype, note)
        return func(*args, **kwargs)
    return handler


_TENSOR_BASE = getattr(torch._C, "TensorBase", None) or getattr(torch._C, "_TensorBase")


def _getter(name: str) -> Any:
    return _TENSOR_BASE.__dict__[name]


_SPECIAL: dict[Any, Callable[..., Any]] = {
    _getter("device"): _h_device,
    _getter("is_cuda"): _h_is_cuda,
    _getter("is_cpu"): _h_is_cpu,
    _getter("data"): _h_data,
    torch.Tensor.get_device: _h_get_device,
    torch.Tensor.to: _h_to,
    torch.Tensor.cuda: _h_cuda,
    torch.Tensor.cpu: _h_cpu,
    torch.Tensor.numpy: _reads_host("Tensor.numpy", "raises on a real target: call .cpu() first"),
    torch.Tensor.__array__: _reads_host("Tensor.__array__", "raises on a real target: call .cpu() first"),
    torch.Tensor.tolist: _reads_host("Tensor.tolist"),
}
if hasattr(torch.Tensor, "npu"):  # torch_npu loaded but the audit is logical
    _SPECIAL[torch.Tensor.npu] = _h_npu


class _AuditDispatchMode(TorchDispatchMode):
    def __init__(self, tracker: _Tracker):
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        __tracebackhide__ = True  # pytest shows the model's frames, not the audit's
        return self.tracker.on_dispatch(func, args, kwargs or {})


class _LogicalFunctionMode(TorchFunctionMode):
    def __init__(self, tracker: _Tracker):
        super().__init__()
        self.tracker = tracker

    def __torch_function__(self, func, types, args=(), kwargs=None):
        __tracebackhide__ = True  # pytest shows the model's frames, not the audit's
        return self.tracker.on_function(func, args, kwargs or {})
