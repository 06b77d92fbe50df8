"""Device-propagation audit: what one run on the target did across the host/device boundary.

A port to an accelerator rarely fails with a wrong number; it fails with a tensor on the wrong
device: a mask or constant built on the CPU inside ``forward``, a hard-coded ``.cuda()`` or
``.to(0)``, a float64 constant reaching a device without fp64, an op that runs on the CPU, a host
sync in a hot path. :class:`DeviceAudit` records, for one run, every

==================  ===========================================================================
kind                what is recorded
==================  ===========================================================================
``mixed_device``    an op whose tensor arguments span two devices (0-dim CPU tensors aside, as
                    PyTorch allows them anywhere); also a copy between two different
                    accelerator devices (``cuda:1`` → ``cuda:0``)
``h2d``             a host→device copy (``.to(device)``, ``.cuda()``, ``copy_``, a CPU index
                    tensor used to index a device tensor)
``d2h``             a device→host copy (``.cpu()``, ``.to("cpu")``, ``.tolist()``, ``.numpy()``);
                    a blocking copy is a host sync too, it is counted here only
``host_sync``       an op whose result the host must wait for: ``.item()``/``bool()``/``int()``
                    (``aten::_local_scalar_dense``), ``torch.equal``, and ops with a
                    data-dependent output shape (``nonzero``, ``masked_select``, boolean-mask
                    indexing, ``unique`` …) — PyTorch's own op tags ``data_dependent_output`` and
                    ``dynamic_output_shape`` (``native_functions.yaml``) select them
``cpu_fallback``    an op that ran on the CPU while the module runs on the target (all its
                    tensors on the host, at least one not 0-dim: a constant built on the host
                    inside ``forward``); an op with target inputs and a CPU output; an op the
                    caller declared unsupported on the target (``unsupported_ops``) running on
                    target tensors
``fp64``            an op with a float64/complex128 tensor on the target (NPUs have no fp64:
                    ``transfer_to_npu`` downcasts it to fp32 silently)
==================  ===========================================================================

Each event carries the op, the devices, the dtype, a count, and the source line that caused it:
the innermost Python frame outside ``torch``, ``einops`` and this package's engine modules
(``file:line`` and the code text), so a message reads::

    mixed-device op aten::add.Tensor: cuda:1 + cpu at /path/model.py:42  return x + torch.ones(n)

Budgets: what a check may do
----------------------------
:class:`AuditBudget` says how many events of each kind a run may have (:data:`DEFAULT_AUDIT_BUDGET`:
no mixed-device op, no host<->device copy, no CPU op, no float64 on the target; host syncs counted
but allowed); :meth:`AuditBudget.judge` turns a record into the message of the events beyond it,
with the budget that would pass. The plugin's ``--parity-audit`` judges every audited check by its
budget (``parse_audit_budget`` specs from a suite's ``parity_audit_budget`` fixture,
``@pytest.mark.parity(audit_budget=...)`` and ``parity.check(audit_budget=...)``) and fails it or
warns (:class:`ParityAuditWarning`). The plugin's own work inside a run is never the model's:
:func:`not_audited` keeps tensors tracked and records nothing (the shared random stream's CPU
draws of dropout masks and their copy to the device, a training step's gradient clipping and
optimizer step).

Two modes behind one API
------------------------
*Real-device mode* (the target exists here, e.g. ``npu:0`` with torch_npu or ``cuda:0``): the
module runs on the target under a ``TorchDispatchMode`` that sees every ATen op with its real
tensors and devices. Python-level host syncs reach dispatch as ATen ops too (``.item()`` is
``_local_scalar_dense``, ``.cpu()``/``.tolist()`` are ``_to_copy``; ``.numpy()`` of a device
tensor raises by itself), so no ``TorchFunctionMode`` is needed. A dispatch mode leaves PyTorch's
``has_torch_function`` guards alone, so the audited run takes the same kernels (for example the
``nn.TransformerEncoderLayer`` fast path) as an unaudited one. A mixed-device op is recorded before
it runs, so it is in the record even though the real op then raises.

*Logical-device mode* (CPU-only machines): the target is a *logical* device such as ``cuda:1`` while
every tensor stays a real CPU tensor, so the run is numerically a CPU run on real data, including
the data-dependent parts. A side table keyed by tensor identity (weak references, so it keeps
no tensor alive) records which tensors live on which logical device; tensors absent from it
are on the host. The dispatch mode propagates the marks (an op's outputs live where its inputs
live) and classifies ops with the same rules as real-device mode. A ``TorchFunctionMode`` handles
what happens before dispatch: ``tensor.device``/``is_cuda``/``get_device()`` report the logical
device (upstream code such as ``causal_attention_mask(n).to(x.device)`` or
``torch.arange(n, device=x.device)`` must see it); a factory call with ``device=<accelerator>``
runs on the CPU and its result is marked (the call must be rewritten before PyTorch's Python
binding, which initializes CUDA for ``device="cuda"`` and fails without a driver);
``.to()``/``.cuda()``/``.cpu()`` copy between host and logical devices; ``.numpy()``/``.tolist()``
of a logical tensor are recorded as device→host copies (``.numpy()`` of a device tensor raises on
a real target: call ``.cpu()`` first).

Why not the alternatives:

* ``FakeTensorMode`` (docs/explanation/findings.md, "Devices without hardware") runs a model on a fake ``cuda``
  device on this CPU-only machine, but shape-only: it stops at the first data-dependent op
  (``DataDependentOutputException`` in the retriever's ``TransformerEncoder`` mask check;
  ``.numpy() is not supported for tensor subclasses`` in ``_period_search``) — exactly the host
  syncs this audit must report — and it raises at the first mixed-device op instead of recording
  all of them.
* A wrapper tensor subclass (``_make_wrapper_subclass`` reporting the logical device) needs the
  same function mode for factories and ``.cuda()`` (CUDA is initialized before dispatch), needs
  care for in-place metadata ops (``unsqueeze_`` on a wrapper must also resize the wrapper) and
  refuses ``.numpy()``; the side table keeps plain CPU tensors, so every kernel and every view is
  the CPU's own.

Numerics: real-device mode changes nothing. In logical mode the active ``TorchFunctionMode``
makes ``torch.overrides.has_torch_function`` true, so ``nn.MultiheadAttention`` and
``nn.TransformerEncoderLayer`` skip their inference fast path (as they do under any function mode
or tensor subclass); outputs are bitwise those of a plain CPU run with
``torch.backends.mha.set_fastpath_enabled(False)`` and otherwise of a plain CPU run (the fast path
differs by about 2e-7 on Aurora's retriever, measured).

Backward in logical mode: autograd's backward formulas run in C++ and pass the tensors' *real*
device (the CPU) to the ops they call (``grad.new_zeros(sizes, self.options())``); inside a
backward (``torch._C._current_autograd_node()`` set) an explicit CPU device means the device of the
op's tensor arguments, or the target for a factory, so a clean model's training step reports nothing.

Model of devices in logical mode: ``device="cuda"`` without an index and ``.cuda()`` mean index 0
(PyTorch's default current device); ``.to(i)`` with an integer means index ``i`` of the target's
device type. Pick a logical target with a non-zero index (:data:`DEFAULT_LOGICAL_TARGET` is
``cuda:1``) and hard-coded devices show up as a second device in mixed-device ops. ``npu`` cannot
be a logical target without torch_npu (``torch.device("npu")`` does not parse then); the rules
are device-type independent, so ``cuda:1`` stands in for it. "CPU fallback" in logical mode means
host-side ops during the run and ops named in ``unsupported_ops`` on target tensors (a logical
device cannot fall back by itself). Not modelled: ``torch.cuda.*`` runtime calls
(``torch.cuda.is_available()`` stays False inside the run), ``torch.Generator(device=...)``,
legacy typed constructors (``torch.cuda.FloatTensor``) — they behave as without the audit — and
``torch.autocast`` for the logical device type, which does not touch the CPU tensors (use CPU
autocast for a bf16 recipe in logical mode).

Cost: nothing unless an audit runs (no hook stays installed). The audit adds Python work per op,
so the ratio depends on op size. Logical mode, eval forward, 2-core CPU, one thread, measured: an
Aurora with ViT-base/BERT-base-sized encoders (hidden 64) 1.3–1.5× a plain CPU forward; the
project's tiny Aurora (1.2 M parameters, ~1 200 small ops) about 5.5×, of which PyTorch's own
mode dispatch (a no-op dispatch mode plus a no-op function mode) is 2.5×
(``tests/test_audit.py::test_audit_overhead_is_bounded`` prints the ratio).

Usage::

    audit = DeviceAudit("cuda:1")            # logical on a CPU-only machine, real where it exists
    model, x = audit.to_target(model), audit.to_target(x)
    out = audit.run(model, x)                # or: with audit: out = model(x)
    print(audit.record.format())
    audit.record.assert_clean({"h2d": 2})    # DevicePropagationError lists what is unexpected

    out, record = audit_call(model, (x,), target="cuda:1")   # the same in one call
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import linecache
import os
import sys
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map
from torch.utils._python_dispatch import TorchDispatchMode

#: Event kinds, in report order.
KINDS = ("mixed_device", "h2d", "d2h", "host_sync", "cpu_fallback", "fp64")

#: A logical target for CPU-only machines. Index 1, so that a hard-coded ``.cuda()``,
#: ``.to(0)`` or ``device="cuda"`` lands on a *different* device (``cuda:0``) and is caught.
DEFAULT_LOGICAL_TARGET = "cuda:1"

_HOST = torch.device("cpu")
_FP64 = (torch.float64, torch.complex128)

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


class DevicePropagationError(AssertionError):
    """An audit found events beyond what was allowed; ``record`` holds the whole :class:`AuditRecord`."""

    def __init__(self, message: str, record: "AuditRecord"):
        super().__init__(message)
        self.record = record


# ------------------------------------------------------------------------------------------------
# Records
# ------------------------------------------------------------------------------------------------

_PHRASES = {
    "mixed_device": "mixed-device op",
    "h2d": "host-to-device copy",
    "d2h": "device-to-host copy",
    "host_sync": "host sync",
    "cpu_fallback": "CPU op",
    "fp64": "float64 on the target",
}
_COPY_NOTE = "copy between two devices"


def _devices_text(kind: str, devices: tuple[str, ...], note: str) -> str:
    if kind in ("h2d", "d2h") or note == _COPY_NOTE:
        return " -> ".join(devices)
    return (" + " if kind == "mixed_device" else ", ").join(devices)


@dataclass
class AuditEvent:
    """One kind of event at one source line, with how often it happened.

    Attributes:
        kind: one of :data:`KINDS`.
        op: the ATen op as dispatched (``aten::add.Tensor``), or the Python API for what logical
            mode handles before dispatch (``Tensor.to``, ``Tensor.cuda``, ``Tensor.numpy``).
        devices: the devices involved, as strings: the op's distinct devices for
            ``mixed_device``; ``(source, destination)`` for copies; the tensor's device otherwise.
        dtype: the dtype concerned (``"torch.float64"`` for ``fp64``, the copied tensor's dtype for
            copies, the stray tensor's for ``mixed_device``, the result's for a CPU op), or None.
        source: ``"/path/file.py:LINE"`` of the innermost frame outside torch, einops and this
            package's engine modules, or ``"<unknown>"``.
        code: that line's code text ("" when not available).
        count: how many times it happened during the run.
        note: a short explanation where the kind alone is not enough.
    """

    kind: str
    op: str
    devices: tuple[str, ...]
    dtype: str | None
    source: str
    code: str = ""
    count: int = 1
    note: str = ""

    def message(self) -> str:
        """One line: what, where, with the code text, e.g.
        ``mixed-device op aten::add.Tensor: cuda:1 + cpu at model.py:42  x + torch.ones(n)``."""
        where = _devices_text(self.kind, self.devices, self.note)
        text = f"{_PHRASES[self.kind]} {self.op}: {where}"
        if self.dtype:
            text += f" {self.dtype.removeprefix('torch.')}"
        if self.note:
            text += f" ({self.note})"
        text += f" at {self.source}"
        if self.code:
            text += f"  {self.code}"
        if self.count > 1:
            text += f"  [x{self.count}]"
        return text


@dataclass
class AuditRecord:
    """The device-propagation record of one or more audited runs on one target.

    Attributes:
        target: the target device as a string (``"cuda:1"``, ``"npu:0"``).
        logical: True when the target was logical (data on the CPU).
        events: distinct events, deduplicated by (kind, op, source), in first-seen order.
        skipped: why nothing was audited (target is the CPU), else None.
    """

    target: str
    logical: bool
    events: list[AuditEvent] = field(default_factory=list)
    skipped: str | None = None
    _index: dict = field(default_factory=dict, repr=False, compare=False)

    def add(self, kind: str, op: str, devices: Iterable[torch.device | str], dtype: torch.dtype | None = None,
            note: str = "", source: tuple[str, str] | None = None) -> AuditEvent:
        """Count one event; the source line is taken from the current Python stack unless given.

        Raises:
            ValueError: ``kind`` is not one of :data:`KINDS`.
        """
        if kind not in KINDS:
            raise ValueError(f"audit event kind {kind!r} is not one of {', '.join(KINDS)}")
        where, code = source if source is not None else caller_source()
        key = (kind, op, where)
        event = self._index.get(key)
        if event is not None:
            event.count += 1
            return event
        event = AuditEvent(kind, op, tuple(str(d) for d in devices), None if dtype is None else str(dtype),
                           where, code, 1, note)
        self._index[key] = event
        self.events.append(event)
        return event

    def counts(self) -> dict[str, int]:
        """Occurrences per kind, every kind of :data:`KINDS` present (0 when none); ``{}`` when skipped."""
        if self.skipped:
            return {}
        totals = dict.fromkeys(KINDS, 0)
        for event in self.events:
            totals[event.kind] += event.count
        return totals

    def of_kind(self, kind: str) -> list[AuditEvent]:
        """The events of one kind, in first-seen order."""
        return [e for e in self.events if e.kind == kind]

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form for reports: target, logical, skipped, counts and every event."""
        return {
            "target": self.target,
            "logical": self.logical,
            "skipped": self.skipped,
            "counts": self.counts(),
            "events": [{k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(e).items()}
                       for e in self.events],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "AuditRecord":
        """The record :meth:`to_dict` wrote (``CheckRecord.audit``)."""
        record = cls(str(data["target"]), bool(data.get("logical")), skipped=data.get("skipped"))
        for e in data.get("events") or ():
            event = AuditEvent(e["kind"], e["op"], tuple(e.get("devices") or ()), e.get("dtype"), e["source"],
                               e.get("code", ""), int(e.get("count", 1)), e.get("note", ""))
            record._index[(event.kind, event.op, event.source)] = event
            record.events.append(event)
        return record

    def format(self) -> str:
        """A readable table: a header with the counts, then one line per event (most frequent first)."""
        mode = "logical" if self.logical else "real"
        if self.skipped:
            return f"device-propagation audit on {self.target} ({mode}): not audited: {self.skipped}"
        counts = self.counts()
        head = (f"device-propagation audit on {self.target} ({mode}): "
                + ", ".join(f"{k} {v}" for k, v in counts.items()))
        if not self.events:
            return head + "\nno events"
        rows = [("kind", "count", "op", "devices", "dtype", "source", "code")]
        order = sorted(self.events, key=lambda e: (KINDS.index(e.kind), -e.count))
        for e in order:
            rows.append((e.kind, str(e.count), e.op, _devices_text(e.kind, e.devices, e.note),
                         (e.dtype or "").removeprefix("torch."),
                         e.source, e.code + (f"  ({e.note})" if e.note else "")))
        widths = [max(len(r[i]) for r in rows) for i in range(6)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r[:6], widths)) + "  " + r[6] for r in rows]
        return head + "\n" + "\n".join(line.rstrip() for line in lines)

    def assert_clean(self, allowed: Mapping[str, int] | None = None) -> None:
        """Raise unless every kind stays within its allowance.

        Args:
            allowed: maximum occurrences per kind (e.g. ``{"h2d": 2}``); kinds not named allow 0.

        Raises:
            ValueError: ``allowed`` names a kind that is not in :data:`KINDS` or a negative count.
            DevicePropagationError: some kind exceeds its allowance; the message lists the counts
                and every event of those kinds with its op, devices and source line.
        """
        allowed = dict(allowed or {})
        for kind, limit in allowed.items():
            if kind not in KINDS:
                raise ValueError(f"assert_clean: allowed kind {kind!r} is not one of {', '.join(KINDS)}")
            if not isinstance(limit, int) or limit < 0:
                raise ValueError(f"assert_clean: allowed[{kind!r}] must be a count >= 0, got {limit!r}")
        counts = self.counts()
        over = [k for k, n in counts.items() if n > allowed.get(k, 0)]
        if not over:
            return
        mode = "logical" if self.logical else "real"
        lines = [f"device-propagation audit on {self.target} ({mode}) found unexpected events: "
                 + ", ".join(f"{k} {counts[k]} (allowed {allowed.get(k, 0)})" for k in over)]
        lines += ["  " + e.message() for e in self.events if e.kind in over]
        raise DevicePropagationError("\n".join(lines), self)


# ------------------------------------------------------------------------------------------------
# Budgets: what a check may do on the target (the plugin's --parity-audit)
# ------------------------------------------------------------------------------------------------

#: How an audited parity check treats events beyond its budget (``--parity-audit``,
#: ``--parity-audit-mode``, ini ``parity_audit``, ``@pytest.mark.parity(audit=...)``): ``fail`` fails the check with the events,
#: ``warn`` reports them and issues a :class:`ParityAuditWarning` (the verdict stays the
#: comparison's), ``off`` audits nothing.
AUDIT_MODES = ("off", "warn", "fail")

#: The budget of a check that declares none: no mixed-device op, no host<->device copy inside the
#: run, no CPU op, no float64 on the target; host syncs (``.item()``, data-dependent shapes) are
#: counted and shown but allowed (they cost time, they do not change a result).
DEFAULT_AUDIT_BUDGET: Mapping[str, int | None] = {"mixed_device": 0, "h2d": 0, "d2h": 0, "host_sync": None,
                                                  "cpu_fallback": 0, "fp64": 0}

_ANY = ("any", "*", "inf", "unlimited")


_FIX_HINTS = {
    "mixed_device": "create tensors on the input's device: device=x.device",
    "cpu_fallback": "create tensors on the input's device: device=x.device",
    "h2d": "keep data on the device: register constants as buffers, no .cpu()/.numpy() round trip",
    "d2h": "keep data on the device: register constants as buffers, no .cpu()/.numpy() round trip",
    "host_sync": "avoid .item(), bool() and data-dependent shapes of device tensors",
    "fp64": "use the input's dtype (dtype=x.dtype), not float64",
}


class ParityAuditWarning(UserWarning):
    """Events beyond a check's audit budget under ``--parity-audit-mode=warn`` (the message lists them)."""


def _budget_limit(value: Any, kind: str, spec: Any) -> int | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in _ANY):
        return None
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            value = value.strip()
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"audit budget {spec!r}: {kind}={value!r} must be a count >= 0 or 'any'")
    return value


@dataclass(frozen=True)
class AuditBudget:
    """How many events of each kind a check's audited target run may have.

    Attributes:
        allowed: kind (every one of :data:`KINDS`) -> the most occurrences allowed, None for any number.
        source: where it was set: ``default``, ``suite`` (a ``parity_audit_budget`` fixture),
            ``marker`` (``@pytest.mark.parity(audit_budget=...)``) or ``check`` (``parity.check``).
        reason: why the check may do more than the default (shown in the report), or None.
    """

    allowed: Mapping[str, int | None] = field(default_factory=lambda: dict(DEFAULT_AUDIT_BUDGET))
    source: str = "default"
    reason: str | None = None

    def replace(self, spec: Any, *, source: str) -> "AuditBudget":
        """This budget with the kinds ``spec`` names changed (``parse_audit_budget(spec, base=self)``)."""
        return parse_audit_budget(spec, source=source, base=self)

    def describe(self) -> str:
        """``mixed_device 0, h2d 2, d2h 0, host_sync any, cpu_fallback 0, fp64 0`` (+ `` # reason``)."""
        text = ", ".join(f"{k} {'any' if self.allowed.get(k) is None else self.allowed[k]}" for k in KINDS)
        return text + (f" # {self.reason}" if self.reason else "")

    def excess(self, record: "AuditRecord") -> dict[str, tuple[int, int]]:
        """Kinds over budget -> (occurrences, allowed), in :data:`KINDS` order; ``{}`` when within
        budget or when the record was skipped."""
        counts = record.counts()
        out = {}
        for kind in KINDS:
            limit = self.allowed.get(kind)
            if limit is not None and counts.get(kind, 0) > limit:
                out[kind] = (counts[kind], limit)
        return out

    def judge(self, record: "AuditRecord", check: str = "", *, failing: bool = True) -> str | None:
        """Why ``record`` exceeds this budget, as a readable message, or None when it does not.

        The message names the kinds over budget with their counts, then every event of those kinds
        (op, devices, dtype, the model's source line and its code; paths relative to the working
        directory when below it), then how to fix or allow them (the budget that would pass; with
        ``failing``, also how to report them without failing).
        """
        over = self.excess(record)
        if not over:
            return None
        where = (f"the logical device {record.target} (this machine's CPU run, tracked as an accelerator would "
                 "see it)" if record.logical else record.target)
        n = sum(count for count, _ in over.values())
        what = f"check {check!r}" if check else "the run"
        lines = [f"Device-propagation audit of {what} on {where}: {n} event{'s' * (n != 1)} beyond its audit "
                 "budget: " + ", ".join(f"{k} {c} (allowed {a})" for k, (c, a) in over.items()) + "."]
        events = sorted((e for e in record.events if e.kind in over), key=lambda e: (KINDS.index(e.kind), -e.count))
        lines += ["  " + _with_short_source(e).message() for e in events]
        wanted = {k: c for k, (c, _) in over.items()}
        hints = list(dict.fromkeys(_FIX_HINTS[k] for k in over))
        lines.append(f"Fix these lines ({'; '.join(hints)}), or allow them with audit_budget={wanted!r} and a "
                     "reason (parity.check argument or @pytest.mark.parity)"
                     + (", or report without failing with --parity-audit-mode=warn." if failing else "."))
        return "\n".join(lines)


def parse_audit_budget(spec: Any, *, source: str = "check", base: AuditBudget | None = None) -> AuditBudget:
    """An :class:`AuditBudget` from ``spec``, over ``base`` (default: :data:`DEFAULT_AUDIT_BUDGET`).

    ``spec`` is None (``base`` itself), an :class:`AuditBudget`, a mapping ``{kind: count}`` (a
    count is an int >= 0, or None/``"any"`` for any number; an optional ``"reason"`` key), or a
    string ``"h2d=2 host_sync=0 cpu_fallback=any # reason"`` (commas also separate). Kinds not
    named keep ``base``'s allowance.

    Raises:
        ValueError: an unknown kind (the message lists :data:`KINDS`), a negative or non-integer
            count, a token that is not ``kind=count``, or a spec of another type.
    """
    base = base if base is not None else AuditBudget()
    if spec is None:
        return base
    if isinstance(spec, AuditBudget):
        return spec
    reason = None
    if isinstance(spec, str):
        text, _, comment = spec.partition("#")
        reason = comment.strip() or None
        items = []
        for token in text.replace(",", " ").split():
            kind, sep, value = token.partition("=")
            if not sep:
                raise ValueError(f"audit budget {spec!r}: {token!r} is not kind=count (e.g. 'h2d=2 host_sync=any')")
            items.append((kind.strip(), value))
    elif isinstance(spec, Mapping):
        items = [(str(k), v) for k, v in spec.items() if k != "reason"]
        reason = spec.get("reason")
        if reason is not None and (not isinstance(reason, str) or not reason.strip()):
            raise ValueError(f"audit budget {spec!r}: reason must be a non-empty string")
    else:
        raise ValueError(f"audit budget {spec!r} must be a dict such as {{'h2d': 2}} or a string such as "
                         "'h2d=2 host_sync=any # reason'")
    allowed = dict(base.allowed)
    for kind, value in items:
        if kind not in KINDS:
            import difflib

            close = difflib.get_close_matches(kind, KINDS, n=1)
            raise ValueError(f"audit budget {spec!r}: unknown kind {kind!r}"
                             + (f" (did you mean {close[0]!r}?)" if close else "") + f"; kinds: {', '.join(KINDS)}")
        allowed[kind] = _budget_limit(value, kind, spec)
    return AuditBudget(allowed, source=source, reason=(reason.strip() if reason else None) or base.reason)


def _with_short_source(event: AuditEvent) -> AuditEvent:
    """``event`` with its source path relative to the working directory when it lies below it."""
    path, sep, line = event.source.rpartition(":")
    if not sep or not os.path.isabs(path):
        return event
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive
        return event
    if rel.startswith(os.pardir):
        return event
    return AuditEvent(**{**asdict(event), "source": f"{rel}:{line}", "devices": event.devices})


# ------------------------------------------------------------------------------------------------
# Source lines
# ------------------------------------------------------------------------------------------------

def _package_dir(name: str) -> str | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(os.path.abspath(list(spec.submodule_search_locations)[0]), "")


_SKIPPED_DIRS = tuple(d for d in (_package_dir("torch"), _package_dir("einops")) if d)
# This package's engine modules (its top-level files); its suites' subpackages (e.g. the Aurora
# patch set) are model adaptation code whose lines are worth showing.
_ENGINE_DIR = os.path.dirname(os.path.abspath(__file__))
_SKIPPED_FILES = {os.path.abspath(contextlib.__file__), os.path.abspath(functools.__file__)}
_internal_cache: dict[str, bool] = {}


def _is_internal(filename: str) -> bool:
    hit = _internal_cache.get(filename)
    if hit is None:
        path = os.path.abspath(filename)
        hit = path in _SKIPPED_FILES or path.startswith(_SKIPPED_DIRS) or os.path.dirname(path) == _ENGINE_DIR
        _internal_cache[filename] = hit
    return hit


def caller_source() -> tuple[str, str]:
    """``("/path/file.py:LINE", code text)`` of the innermost frame outside torch, einops, this
    package's engine modules and ``contextlib``/``functools``; ``("<unknown>", "")`` if none."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not _is_internal(filename):
            line = frame.f_lineno
            return f"{filename}:{line}", linecache.getline(filename, line).strip()
        frame = frame.f_back
    return "<unknown>", ""


# ------------------------------------------------------------------------------------------------
# Devices
# ------------------------------------------------------------------------------------------------

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


# ------------------------------------------------------------------------------------------------
# Public entry points
# ------------------------------------------------------------------------------------------------

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
