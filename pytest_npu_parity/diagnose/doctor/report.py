"""The doctor's report: its sections and their order (the engine's and the installed adapters'),
the JSON Schema of ``doctor --json``, one section's result (:class:`SectionResult`), what every
section reads (:class:`DoctorContext`) and the text for people (:func:`render_text`).
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import math
from typing import Any

from ... import adapters
from ...runtime import npu

SCHEMA_VERSION = 1
EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
STATUSES = ("ok", "warn", "fail", "skip")
#: The engine's own sections and their titles; the adapters' sections go after :data:`_ADAPTER_SLOT`.
ENGINE_SECTIONS: dict[str, str] = {
    "environment": "Basic environment",
    "devices": "Device status",
    "required_ops": "Required ops",
    "optional_ops": "Optional ops",
    "distributed": "Distributed backend",
    "deepspeed": "DeepSpeed",
    "precision": "Precision flags",
}
#: The engine section after which the adapters' sections run (the model's checks follow the op probes).
_ADAPTER_SLOT = "optional_ops"


def _adapter_sections() -> list[adapters.DoctorSection]:
    found = [section for adapter in adapters.discover() for section in adapter.doctor_sections]
    names = [s.name for s in found]
    clash = sorted({n for n in names if n in ENGINE_SECTIONS or names.count(n) > 1})
    if clash:
        raise adapters.AdapterError(f"doctor section name(s) {', '.join(clash)} given twice (engine or adapters)")
    return found


def sections() -> dict[str, str]:
    """``{name: title}`` of every section in run order: the engine's, with the installed adapters'
    (``adapters.discover()``) after the op probes.

    Raises:
        adapters.AdapterError: an adapter's section name is taken.
    """
    ordered: dict[str, str] = {}
    for name, title in ENGINE_SECTIONS.items():
        ordered[name] = title
        if name == _ADAPTER_SLOT:
            ordered.update((s.name, s.title) for s in _adapter_sections())
    return ordered


def __getattr__(name: str) -> Any:
    # SECTIONS and DOCTOR_JSON_SCHEMA depend on the installed adapters: computed when read (PEP 562),
    # so importing this module loads no adapter.
    if name == "SECTIONS":
        return sections()
    if name == "DOCTOR_JSON_SCHEMA":
        return doctor_json_schema()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def doctor_json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of ``doctor --json`` (also ``DOCTOR_JSON_SCHEMA``): section names
    are those of :func:`sections`."""
    return _json_schema(list(sections()))


def _json_schema(names: list[str]) -> dict[str, Any]:
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "pytest-npu-parity doctor report",
        "type": "object",
        "additionalProperties": False,
        "required": ["schema_version", "tool", "tool_version", "requested_device", "target",
                     "target_error", "sections", "summary"],
        "properties": {
            "schema_version": {"const": SCHEMA_VERSION},
            "tool": {"const": "pytest-npu-parity doctor"},
            "tool_version": {"type": ["string", "null"]},
            "requested_device": {"type": "string"},
            "target": {"type": ["string", "null"], "description": "resolved target, e.g. 'npu:0'"},
            "target_error": {"type": ["string", "null"],
                             "description": "why the requested device is unavailable (one sentence)"},
            "sections": {
                "type": "array",
                "items": {"$ref": "#/$defs/section"},
                "minItems": 1,
            },
            "summary": {
                "type": "object",
                "additionalProperties": False,
                "required": ["status", "exit_code", "counts", "failing_sections", "duration_s"],
                "properties": {
                    "status": {"enum": ["ok", "warn", "fail"]},
                    "exit_code": {"enum": [EXIT_OK, EXIT_FAIL]},
                    "counts": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": list(STATUSES),
                        "properties": {s: {"type": "integer", "minimum": 0} for s in STATUSES},
                    },
                    "failing_sections": {"type": "array", "items": {"enum": list(names)}},
                    "duration_s": {"type": "number", "minimum": 0},
                },
            },
        },
        "$defs": {
            "section": {
                "type": "object",
                "additionalProperties": False,
                "required": ["name", "title", "status", "details", "fixes", "data", "duration_s"],
                "properties": {
                    "name": {"enum": list(names)},
                    "title": {"type": "string"},
                    "status": {"enum": list(STATUSES)},
                    "details": {"type": "array", "items": {"type": "string"}},
                    "fixes": {"type": "array", "items": {"type": "string"},
                              "description": "one sentence each, naming the fix"},
                    "data": {"type": "object", "description": "machine-readable facts of the section"},
                    "duration_s": {"type": "number", "minimum": 0},
                },
            },
        },
    }


@dataclasses.dataclass
class SectionResult:
    """One doctor section.

    Attributes:
        name: key from :func:`sections`.
        status: ``ok`` | ``warn`` | ``fail`` | ``skip``.
        details: lines for people (facts found).
        fixes: one sentence each saying what to do (empty when nothing to do).
        data: JSON-serialisable facts for CI.
        duration_s: wall time of the section in seconds.
    """

    name: str
    status: str = "ok"
    details: list[str] = dataclasses.field(default_factory=list)
    fixes: list[str] = dataclasses.field(default_factory=list)
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    duration_s: float = 0.0

    def worse(self, status: str) -> None:
        """Raise the status to ``status`` if that is worse (ok < skip < warn < fail)."""
        order = {"ok": 0, "skip": 1, "warn": 2, "fail": 3}
        if order[status] > order[self.status]:
            self.status = status

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "title": sections()[self.name], "status": self.status,
                "details": list(self.details), "fixes": list(self.fixes),
                "data": _jsonable(self.data), "duration_s": round(self.duration_s, 4)}


@dataclasses.dataclass
class DoctorContext:
    """What every section reads: the requested device, torch (or why it did not import), the NPU
    status, the resolved target (or why there is none) and the launcher steps done for it.

    A section starts with ``if ctx.no_target(result): return`` when it needs a usable target.
    """

    requested: str
    torch: Any = None
    torch_error: str | None = None
    status: npu.NpuStatus | None = None
    target: Any = None  # torch.device | None
    target_error: str | None = None
    fft_fallback_needed: bool | None = None
    deepspeed_config: str | None = None  # --deepspeed-config FILE
    deepspeed_findings: list | None = None  # its deepspeed_config.Finding list (None: not given)
    launch: npu.LaunchRecord | None = None  # the launcher steps done for an NPU target (npu.launch)
    launch_error: str | None = None

    def no_target(self, result: SectionResult) -> bool:
        """Mark ``result`` skipped when there is no usable target; True if so."""
        if self.target is None:
            result.status = "skip"
            why = "torch is not importable, see Basic environment" if self.torch_error \
                else "see Device status"
            result.details.append(f"skipped: target {self.requested!r} is unavailable ({why})")
            return True
        return False

    def cpu_note(self) -> str | None:
        if self.target is not None and self.target.type == "cpu":
            no_npu = " (no NPU, see devices)" if self.status and not self.status.available else ""
            return (f"target is the CPU{no_npu}: each op is compared with itself, so this checks "
                    "only that it runs")
        return None


_Context = DoctorContext  # the name before adapters could write sections


def _jsonable(value: Any) -> Any:
    """Plain JSON types only: non-finite floats become strings, unknown objects their ``str``."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value)


def version_of(dist: str) -> str | None:
    """The installed version of distribution ``dist`` (``"aurora-model"``), or None when it is not installed."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


_version = version_of


def _gib(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:.1f} GiB"


_MARK = {"ok": " OK ", "warn": "WARN", "fail": "FAIL", "skip": "SKIP"}


def render_text(report: dict[str, Any]) -> str:
    """The report for people: one block per section, then the summary line."""
    target = report["target"] or "unavailable"
    lines = [f"pytest-npu-parity doctor — target: {target} (requested: {report['requested_device']})",
             ""]
    for number, section in enumerate(report["sections"], 1):
        lines.append(f"[{_MARK[section['status']]}] {number}. {section['title']}")
        lines.extend(f"       {d}" for d in section["details"])
        lines.extend(f"       fix: {f}" for f in section["fixes"])
        lines.append("")
    summary = report["summary"]
    counts = ", ".join(f"{summary['counts'][s]} {s}" for s in STATUSES)
    failing = (f"; failing: {', '.join(summary['failing_sections'])}"
               if summary["failing_sections"] else "")
    lines.append(f"Summary: {counts} in {summary['duration_s']:.1f} s{failing} — exit "
                 f"{summary['exit_code']}")
    return "\n".join(lines)
