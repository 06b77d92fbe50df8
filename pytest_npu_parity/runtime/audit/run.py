"""The audit's entry points: :class:`DeviceAudit` (records device propagation while code runs on a
target) and :func:`audit_call` (place, run once, return the output and the record).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import torch
from torch.utils._pytree import tree_map

from .devices import _device_available, _parse_device, _with_index
from .events import DEFAULT_LOGICAL_TARGET, AuditRecord
from .tracker import _AuditDispatchMode, _LogicalFunctionMode, _Tracker

class DeviceAudit:
    """Records device propagation while code runs on ``target``; see the module docstring.

    Use :meth:`to_target` for the module and inputs, then :meth:`run` (or ``with audit:``).
    Events of every run accumulate in :attr:`record`. Nothing is installed outside a run.

    Args:
        target: the target device (``"npu:0"``, ``"cuda:1"``, ``torch.device``). ``"cpu"`` gives an
            inert audit whose record says it was skipped (no device boundary to audit).
        logical: True audits a logical device over CPU tensors, False the real device; None
            (default) picks real when the device exists on this machine, else logical.
        unsupported_ops: ATen ops (``"aten::linalg_pinv"`` or with overload
            ``"aten::linalg_pinv.atol_rtol_tensor"``, names as dispatched, i.e. after
            CompositeImplicitAutograd decomposition) that the target lacks; running one on target
            tensors is a ``cpu_fallback`` event.

    Attributes:
        device: the target ``torch.device`` (logical targets always carry an index).
        logical: which mode is used.
        record: the :class:`AuditRecord`.

    Raises:
        ValueError: ``target`` is not a device (for ``npu`` without torch_npu, the message suggests
            the logical stand-in), ``logical=False`` for a device that is absent here, or an
            ``unsupported_ops`` entry without ``::``.
    """

    def __init__(self, target: torch.device | str = DEFAULT_LOGICAL_TARGET, logical: bool | None = None,
                 unsupported_ops: Iterable[str] = ()):
        device = _parse_device(target, "DeviceAudit target")
        unsupported = frozenset(unsupported_ops)
        for op in unsupported:
            if not isinstance(op, str) or "::" not in op:
                raise ValueError(f"DeviceAudit unsupported_ops entry {op!r} must be an ATen op name such as "
                                 "'aten::linalg_pinv'")
        skipped = None
        if device.type == "cpu":
            logical = False
            skipped = (f"target is the CPU: no device boundary to audit; audit a logical "
                       f"'{DEFAULT_LOGICAL_TARGET}' to check device propagation on this machine")
        elif logical is None:
            logical = not _device_available(device)
        elif not logical and not _device_available(device):
            raise ValueError(f"DeviceAudit target {device} is not available on this machine; pass "
                             "logical=True to audit it as a logical device over CPU tensors")
        if logical:
            device = _with_index(device)
        self.device = device
        self.logical = bool(logical)
        self.record = AuditRecord(str(device), self.logical, skipped=skipped)
        self._tracker = _Tracker(device, self.logical, unsupported, self.record)
        self._modes: list[Any] | None = None

    # -- placement -------------------------------------------------------------------------------
    def to_target(self, obj: Any) -> Any:
        """Put a module, a tensor or a nested structure of tensors on the target.

        Real mode: ``module.to(target)`` (in place, as PyTorch does) and ``tensor.to(target)``.
        Logical mode: the module's parameters, buffers and gradients are marked as living on the
        target (data unchanged, in place); a tensor is copied (as ``.to`` would) and the copy is
        marked. Other values pass through. No event is recorded. Inert audit: returned unchanged.

        Returns:
            The module itself, or the structure with tensors replaced.
        """
        if self.record.skipped:
            return obj
        if isinstance(obj, torch.nn.Module):
            if not self.logical:
                return obj.to(self.device)
            for tensor in list(obj.parameters()) + list(obj.buffers()):
                self._tracker.mark(tensor, self.device)
                if tensor.grad is not None:
                    self._tracker.mark(tensor.grad, self.device)
            return obj

        def place(t: Any) -> Any:
            if isinstance(t, torch.nn.Module):
                return self.to_target(t)
            if not isinstance(t, torch.Tensor):
                return t
            if not self.logical:
                return t.to(self.device)
            copy = t.clone()
            self._tracker.mark(copy, self.device)
            return copy

        return tree_map(place, obj)

    def device_of(self, tensor: torch.Tensor) -> torch.device:
        """Where ``tensor`` lives for this audit (logical mode: its logical device, else the host)."""
        return self._tracker.device_of(tensor)

    # -- running ---------------------------------------------------------------------------------
    def __enter__(self) -> "DeviceAudit":
        if self.record.skipped:
            return self
        if self._modes is not None:
            raise RuntimeError("DeviceAudit is already active; audits do not nest")
        modes: list[Any] = [_AuditDispatchMode(self._tracker)]
        if self.logical:
            modes.append(_LogicalFunctionMode(self._tracker))
        entered = []
        try:
            for mode in modes:
                mode.__enter__()
                entered.append(mode)
        except BaseException:
            for mode in reversed(entered):
                mode.__exit__(None, None, None)
            raise
        self._modes = entered
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._modes is None:
            return
        modes, self._modes = self._modes, None
        for mode in reversed(modes):
            mode.__exit__(exc_type, exc, tb)
        if exc is not None and self.record.events and hasattr(exc, "add_note"):
            exc.add_note(f"device-propagation audit on {self.device} up to this error:\n"
                         + "\n".join("  " + e.message() for e in self.record.events))

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call ``fn(*args, **kwargs)`` under the audit and return its result (tensors stay where
        they are: on the target in real mode, CPU tensors in logical mode)."""
        __tracebackhide__ = True
        with self:
            return fn(*args, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        """``record.to_dict()``: what a report stores for this audit."""
        return self.record.to_dict()


def audit_call(fn: Callable[..., Any], args: tuple = (), kwargs: Mapping[str, Any] | None = None, *,
               target: torch.device | str = DEFAULT_LOGICAL_TARGET, logical: bool | None = None,
               unsupported_ops: Iterable[str] = ()) -> tuple[Any, AuditRecord]:
    """Put ``fn``'s module and the inputs on ``target``, run ``fn`` once under a :class:`DeviceAudit`.

    ``fn`` may be an ``nn.Module`` or a bound method of one (``model.generate``); that module is
    placed with :meth:`DeviceAudit.to_target` (in place on a real device). Arguments as
    :class:`DeviceAudit`.

    Returns:
        ``(output, record)``.

    Raises:
        ValueError: as :class:`DeviceAudit`. Whatever ``fn`` raises propagates (in real mode a
            mixed-device op raises; the events up to it are appended as a note on Python >= 3.11).
    """
    audit = DeviceAudit(target, logical=logical, unsupported_ops=unsupported_ops)
    owner = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        audit.to_target(owner)
    args_t = audit.to_target(tuple(args))
    kwargs_t = audit.to_target(dict(kwargs or {}))
    output = audit.run(fn, *args_t, **kwargs_t)
    return output, audit.record
