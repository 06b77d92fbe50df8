"""Audit budgets: how many events of each kind a check's audited target run may have
(:class:`AuditBudget`, :func:`parse_audit_budget`), the audit modes, the fix hints and
:class:`ParityAuditWarning` (the plugin's ``--parity-audit``).
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from .events import KINDS, AuditEvent, AuditRecord

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
