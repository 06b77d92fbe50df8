"""What an audit records: the event kinds, :class:`AuditEvent` (one kind of event at one source
line) and :class:`AuditRecord` (the events of one or more audited runs on one target), with their
phrases, table and JSON form, and :class:`DevicePropagationError`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping

import torch

from .source import caller_source

#: Event kinds, in report order.
KINDS = ("mixed_device", "h2d", "d2h", "host_sync", "cpu_fallback", "fp64")

#: A logical target for CPU-only machines. Index 1, so that a hard-coded ``.cuda()``,
#: ``.to(0)`` or ``device="cuda"`` lands on a *different* device (``cuda:0``) and is caught.
DEFAULT_LOGICAL_TARGET = "cuda:1"


class DevicePropagationError(AssertionError):
    """An audit found events beyond what was allowed; ``record`` holds the whole :class:`AuditRecord`."""

    def __init__(self, message: str, record: "AuditRecord"):
        super().__init__(message)
        self.record = record


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
