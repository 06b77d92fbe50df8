"""``python -m pytest_npu_parity doctor`` (also ``npu-parity doctor``): check the environment first.

Half of a failed NPU port is the environment. Before any parity number is trusted, the doctor
runs the self-check of the Aurora→Ascend adaptation guide's ``verify_npu`` script (seed
``000_76a3155d974abf2f.txt`` §8.1: nine sections) plus the precision flags, against the target
device. Sections marked *adapter* come from the installed model adapters (``pytest_npu_parity.adapters``:
the Aurora adapter's are ``pytest_npu_parity.aurora.doctor_sections``); without one they are absent:

==================  ================================================================================
section             checks
==================  ================================================================================
``environment``     Python, torch, torch_npu, CANN (``version.cfg``), the adapters' lines (Aurora:
                    transformers, aurora-model); the CANN ↔ torch ↔ torch_npu version matrix
                    (``npu.VERSION_MATRIX``)
``devices``         the target (``--device``) and, for an NPU, the launcher steps done before any
                    import of aurora (``npu.launch``); visible NPUs / CUDA devices, ``ASCEND_RT_
                    VISIBLE_DEVICES``, ``npu-smi info`` (health, HBM), device memory
``required_ops``    linear, matmul, SDPA, layer_norm, softmax, … on the target vs the CPU
``optional_ops``    rfft/irfft, pinv, bf16 linear — the patch set can move FFT/pinv to the CPU
``patch_set``       *adapter* (Aurora): self-test of the patch set on a mini patch embedding
``aurora_smoke``    *adapter* (Aurora): the tiny Aurora config runs a forward on the target under
                    the patch set
``distributed``     gloo / nccl / hccl available; a 1-process ``init_process_group`` + all_reduce
``deepspeed``       installed? which build; the accelerator DeepSpeed picks and whether it will use
                    HCCL; ``--deepspeed-config FILE``: lint of the config (``deepspeed_config``)
``precision``       TF32 (CUDA) and HF32 (torch_npu) switches in force
==================  ================================================================================

Each section reports a status — ``ok``, ``warn`` (works, but read the note), ``fail`` or
``skip`` (not applicable here, e.g. "no NPU") — with details and fix sentences.

Exit codes: **0** no section failed (warn/skip allowed), **1** at least one section failed,
**2** usage error (bad option or device spec, a ``--deepspeed-config`` file that is missing or not
JSON).

Output: text for people, ``--json`` for CI; the JSON document validates against
``DOCTOR_JSON_SCHEMA`` (JSON Schema draft 2020-12).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

from . import adapters, npu, troubleshoot
from .process_group import destroy_process_groups

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


# ---------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------


def _section_environment(ctx: _Context, r: SectionResult) -> None:
    r.details.append(f"python {platform.python_version()} ({sys.executable})")
    torch_version = ctx.torch.__version__ if ctx.torch is not None else _version("torch")
    if ctx.torch is None:
        r.worse("fail")
        r.details.append(f"torch {torch_version or 'not installed'}: import failed")
        r.fixes.append(ctx.torch_error or "install torch")
        cuda = None
    else:
        cuda = ctx.torch.version.cuda
        build = f"CUDA {cuda} build" if cuda else "CPU build"
        r.details.append(f"torch {torch_version} ({build})")
    status = ctx.status
    npu_version = status.torch_npu_version if status else None
    if status is None or npu_version is None:
        r.details.append("torch_npu: not installed")
    elif status.available:
        r.details.append(f"torch_npu {npu_version}: imported")
    else:
        r.details.append(f"torch_npu {npu_version}: not usable — {status.reason}")
    cann_info = npu.find_cann()
    if cann_info:
        r.details.append(f"CANN {cann_info.version} (read from {cann_info.source})")
    else:
        r.details.append("CANN: not found (no version.cfg or ascend_toolkit_install.info under "
                         f"{npu._looked_in()})")
    adapter_facts = _adapter_environment(r)

    cann = cann_info.version if cann_info else None
    problems = npu.check_version_matrix(torch_version, npu_version, cann)
    rows = npu.documented_rows(cann=cann, torch=torch_version, torch_npu=npu_version) \
        if (cann or npu_version) else []
    combo = (f"CANN {cann or '?'} ↔ torch {npu.base_version(torch_version) or '?'} ↔ "
             f"torch_npu {npu_version or '-'}")
    if problems:
        r.worse("fail")
        r.details.append(f"version matrix: {combo}: does not match")
        r.fixes.extend(problems)
    elif npu_version is None and cann is None:
        r.details.append("version matrix: skipped (no torch_npu, no CANN: not an Ascend machine)")
    elif rows:
        r.details.append(f"version matrix: {combo}: documented ({rows[0].source})")
    else:
        r.worse("warn")
        r.details.append(f"version matrix: {combo}: not a documented row")
        r.fixes.append(f"{combo} is not in the documented version matrix — prefer a documented "
                       f"row, e.g. CANN {npu.SEED_ROW.cann} + torch {npu.SEED_ROW.torch} + "
                       f"torch_npu {npu.SEED_ROW.torch_npu}")
    notes = npu.matrix_notes(torch_version, npu_version, cann) if (cann or npu_version) else []
    r.details.extend(f"version matrix note: {note}" for note in notes)
    if npu_version and cuda and not (status and status.available):
        _cuda_build_beside_torch_npu(ctx, r, torch_version, npu_version)
    r.data.update(python=platform.python_version(), torch=torch_version, torch_cuda=cuda,
                  torch_npu=npu_version, cann=cann,
                  cann_source=cann_info.source if cann_info else None, **adapter_facts)
    r.data.update(matrix_problems=problems, matrix_notes=notes, matrix_rows=[dataclasses.asdict(x) for x in rows])
    _guide_troubleshooting(ctx, r)


def _adapter_environment(r: SectionResult) -> dict[str, Any]:
    """The adapters' environment lines (``Adapter.doctor_environment``) and a warning for each adapter
    that failed to load; returns their facts for the section's data."""
    facts: dict[str, Any] = {}
    for where, error in adapters.load_errors().items():
        r.worse("warn")
        r.details.append(f"adapter ({where}): failed to load — {error}")
        r.fixes.append(f"the adapter of {where} does not load ({error}): its doctor sections are missing — "
                       "fix its installation or remove it")
    for adapter in adapters.discover():
        if adapter.doctor_environment is not None:
            facts.update(adapter.doctor_environment(r))
    return facts


def _cuda_build_beside_torch_npu(ctx: _Context, r: SectionResult, torch_version: str | None,
                                 npu_version: str) -> None:
    """A CUDA build of torch beside torch_npu: a problem only where a CUDA device is visible.

    Both wheels' ``torch_npu/__init__.py`` refuse to load when ``torch._C._get_accelerator()`` is
    another accelerator (2.5.1: ``!= "cpu"``; 2.14.0 ``_check_device_conflict``: not ``cpu``/``npu``);
    a CUDA build on a machine without a CUDA device reports ``cpu`` there, and the 2.14.0 wheel's
    ``torch==2.14.0.*`` pin accepts the index's CUDA build.
    """
    cuda_visible = bool(ctx.torch is not None and ctx.torch.cuda.is_available())
    if cuda_visible:
        r.worse("warn")
        r.fixes.append(f"torch {torch_version} is a CUDA build beside torch_npu {npu_version} and a CUDA "
                       "device is visible: torch_npu refuses to load next to another accelerator "
                       "(\"Two accelerators cannot be used at the same time\") — install the CPU build of "
                       "torch that matches torch_npu")
    else:
        r.details.append(f"torch {torch_version} is a CUDA build beside torch_npu {npu_version}: no CUDA "
                         "device is visible, so torch_npu's accelerator check passes; on a machine with "
                         "a GPU it would refuse to load")


def _guide_troubleshooting(ctx: _Context, r: SectionResult) -> None:
    """The guides' troubleshooting items that apply here (``troubleshoot``), one fix sentence each.

    An overwritten ``aurora/util_functions.py`` (guide §10.4) fails the section (``import aurora``
    cannot work); missing torch_npu runtime dependencies, a torchvision built for another torch and the
    guide's undocumented ``HCCL_TIMEOUT`` warn; numpy 2 beside torch_npu is a detail line (checklist §0.3's
    pin). Facts go to ``data["troubleshooting"]``.
    """
    found: dict[str, str] = {}
    # numpy 2 beside torch_npu is advice (the checklist names no CANN release), not a problem by itself
    for key, check, status in (("rope_decoder", troubleshoot.rope_decoder_overwritten, "fail"),
                               ("torch_npu_deps", troubleshoot.missing_torch_npu_deps, "warn"),
                               ("torchvision", troubleshoot.torchvision_mismatch, "warn"),
                               ("numpy", troubleshoot.numpy_for_old_cann, "note"),
                               ("hccl_timeout", troubleshoot.hccl_timeout_set, "warn")):
        sentence = check()
        if sentence:
            found[key] = sentence
            if status == "note":
                r.details.append(sentence)
                continue
            r.worse(status)
            r.fixes.append(sentence)
    r.data["troubleshooting"] = found


_NPU_SMI_ROW = re.compile(r"^\|\s*(\d+)\s+(\S+)\s*\|\s*([^|]*?)\s*\|")
_NPU_SMI_PAIR = re.compile(r"(\d+)\s*/\s*(\d+)")


def parse_npu_smi(text: str) -> list[dict[str, Any]]:
    """Devices from ``npu-smi info`` output.

    The table has two lines per NPU (Ascend driver 23.x–25.x)::

        | 0     910B3               | OK            | 98.7        36                0    / 0             |
        | 0                         | 0000:C1:00.0  | 0           0    / 0          3400 / 65536         |

    first line: NPU id, name, health; second line: chip, bus id, AICore %, memory and HBM usage
    (``used / total`` MB, the last pair is HBM).

    Returns:
        ``[{"npu": 0, "name": "910B3", "health": "OK", "hbm_used_mb": 3400, "hbm_total_mb": 65536}]``
        (HBM keys None when not parsed). The process table below the devices is ignored.
    """
    devices: list[dict[str, Any]] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        match = _NPU_SMI_ROW.match(line)
        if not match or match.group(2).lower() in ("name", "chip"):
            continue
        health = match.group(3).strip()
        if not re.match(r"^[A-Za-z][\w-]*$", health):  # process rows: "| 0  0 | 1234 | python ..."
            continue
        entry: dict[str, Any] = {"npu": int(match.group(1)), "name": match.group(2),
                                 "health": health, "hbm_used_mb": None, "hbm_total_mb": None}
        if i + 1 < len(lines):
            pairs = _NPU_SMI_PAIR.findall(lines[i + 1])
            if pairs:
                entry["hbm_used_mb"], entry["hbm_total_mb"] = (int(v) for v in pairs[-1])
        devices.append(entry)
    return devices


def _section_devices(ctx: _Context, r: SectionResult) -> None:
    torch = ctx.torch
    r.details.append(f"requested --device {ctx.requested}: "
                     + (f"target {ctx.target}" if ctx.target is not None else "unavailable"))
    if ctx.target is None:
        r.worse("fail")
        r.fixes.append(ctx.target_error or ctx.torch_error or "fix the torch installation")
    status = ctx.status
    if status and status.available:
        r.details.append(f"NPU: {status.device_count} × {status.device_name} "
                         f"(torch_npu {status.torch_npu_version})")
    else:
        r.details.append(f"no NPU: {status.reason if status else 'not probed'}")
    if ctx.launch is not None:
        r.details.append(f"launcher (before any import of aurora): {ctx.launch.describe()}")
        r.data["launch"] = {"device": ctx.launch.device, "steps": list(ctx.launch.steps)}
    elif ctx.launch_error:
        r.worse("fail")
        r.details.append(f"launcher steps on {ctx.target}: FAILED — {ctx.launch_error}")
        r.fixes.append(f"transfer_to_npu / compile mode / set_device fail on {ctx.target}: {ctx.launch_error}")
    visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
    r.details.append(f"ASCEND_RT_VISIBLE_DEVICES={'unset' if visible is None else visible}")
    r.data.update(npu_available=bool(status and status.available),
                  npu_count=status.device_count if status else 0,
                  npu_name=status.device_name if status else None,
                  npu_reason=status.reason if status else None,
                  ascend_rt_visible_devices=visible)

    smi = shutil.which("npu-smi")
    smi_devices: list[dict[str, Any]] = []
    if smi is None:
        r.details.append("npu-smi: not on PATH (Ascend driver tools absent)")
    else:
        try:
            out = subprocess.run([smi, "info"], capture_output=True, text=True, timeout=30)
            smi_devices = parse_npu_smi(out.stdout) if out.returncode == 0 else []
            if out.returncode != 0:
                r.worse("warn")
                r.details.append(f"npu-smi info failed (exit {out.returncode}): "
                                 f"{(out.stderr or out.stdout).strip()[:200]}")
                r.fixes.append("npu-smi info fails: check the Ascend driver installation "
                               "(npu-smi comes with the driver)")
        except (OSError, subprocess.SubprocessError) as exc:
            r.worse("warn")
            r.details.append(f"npu-smi info could not run: {exc}")
        for dev in smi_devices:
            hbm = (f", HBM {dev['hbm_used_mb']} / {dev['hbm_total_mb']} MB used"
                   if dev["hbm_total_mb"] else "")
            r.details.append(f"npu-smi: NPU {dev['npu']} {dev['name']}, health {dev['health']}{hbm}")
            if dev["health"].upper() != "OK":
                r.worse("warn")
                r.fixes.append(f"npu-smi reports NPU {dev['npu']} health {dev['health']}: check "
                               f"`npu-smi info -t health -i {dev['npu']}` and the driver logs")
        if smi_devices and not (status and status.available):
            r.worse("warn")
            r.fixes.append(f"npu-smi sees {len(smi_devices)} NPU(s) but torch cannot use them: "
                           f"{status.reason if status else 'not probed'}")
    r.data["npu_smi"] = smi_devices if smi else None

    if status and status.available and torch is not None:
        memory = []
        for index in range(status.device_count):
            try:
                free, total = torch.npu.mem_get_info(index)
                memory.append({"npu": index, "free_bytes": int(free), "total_bytes": int(total)})
            except Exception as exc:  # driver quirks must not stop the report
                memory.append({"npu": index, "error": npu._first_line(exc)})
        _mem_get_info_fallback(r, memory)
        for m in memory:
            if "error" not in m:
                r.details.append(f"npu:{m['npu']} memory: {_gib(m['free_bytes'])} free of "
                                 f"{_gib(m['total_bytes'])}")
        r.data["npu_memory"] = memory

    if torch is not None:
        cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if cuda_count:
            for index in range(cuda_count):
                free, total = torch.cuda.mem_get_info(index)
                r.details.append(f"cuda:{index} {torch.cuda.get_device_name(index)}: "
                                 f"{_gib(free)} free of {_gib(total)}")
        else:
            r.details.append("no CUDA device" + (f" (torch is a CUDA {torch.version.cuda} build)"
                                                 if torch.version.cuda else ""))
        r.data["cuda_count"] = cuda_count
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = None
    r.details.append(f"CPU: {os.cpu_count()} cores" + (f", {_gib(ram)} RAM" if ram else ""))
    r.data.update(cpu_count=os.cpu_count(), ram_bytes=ram)


def _mem_get_info_fallback(r: SectionResult, memory: list[dict[str, Any]]) -> None:
    """Checklist §3.4: a ``torch.npu.mem_get_info`` that raised warns, naming the fallback."""
    for m in memory:
        if "error" in m:
            r.worse("warn")
            r.fixes.append(troubleshoot.mem_get_info_fallback(f"npu:{m['npu']}", m["error"]))


def _describe_probe(name: str, probe: npu.OpProbe) -> str:
    if probe.ok:
        return (f"{name}: ok (max |target - cpu| {probe.max_abs_diff:.2g}, rtol {probe.rtol:g}, "
                f"atol {probe.atol:g}, {probe.seconds * 1e3:.1f} ms)")
    return f"{name}: FAILED — {probe.error}"


def _probe_section(ctx: _Context, r: SectionResult, ops: tuple[str, ...]) -> dict[str, npu.OpProbe]:
    note = ctx.cpu_note()
    if note:
        r.details.append(note)
    probes = npu.probe_ops(ctx.target, ops)
    r.details.extend(_describe_probe(name, p) for name, p in probes.items())
    r.data["target"] = str(ctx.target)
    r.data["ops"] = {name: dataclasses.asdict(p) for name, p in probes.items()}
    return probes


def _section_required_ops(ctx: _Context, r: SectionResult) -> None:
    if ctx.no_target(r):
        return
    probes = _probe_section(ctx, r, npu.REQUIRED_OPS)
    failed = [name for name, p in probes.items() if not p.ok]
    if failed:
        r.worse("fail")
        r.fixes.append(f"{', '.join(failed)} fail on {ctx.target}: the Aurora forward cannot run "
                       "there — check the version matrix (environment section) and that CANN's "
                       "kernels package is installed for this chip")


_OPTIONAL_FIXES = {
    "rfft": "torch.fft.rfft/irfft do not run on {target}: the patch set computes them on the CPU "
            "(fft_cpu_fallback, seed §5.3); upgrade CANN to 8.2.RC1 or later to run them on the device",
    "pinv": "torch.linalg.pinv does not run on {target}: the patch set's resample computes it on "
            "the CPU (seed §5.2)",
    "linear_bf16": "bfloat16 linear does not run on {target}: use --parity-dtypes fp32 there",
}


def _section_optional_ops(ctx: _Context, r: SectionResult) -> None:
    if ctx.no_target(r):
        return
    probes = _probe_section(ctx, r, npu.OPTIONAL_OPS)
    ctx.fft_fallback_needed = not (probes["rfft"].ok and probes["irfft"].ok)
    r.data["fft_fallback_needed"] = ctx.fft_fallback_needed
    seen = set()
    for name, probe in probes.items():
        if probe.ok:
            continue
        r.worse("warn")
        key = "rfft" if name in ("rfft", "irfft") else name
        if key not in seen:
            seen.add(key)
            r.fixes.append(_OPTIONAL_FIXES[key].format(target=ctx.target))


def _backend_available(dist: Any, name: str) -> bool:
    check = getattr(dist, "is_backend_available", None)  # torch >= 2.3
    if check is not None:
        try:
            return bool(check(name))
        except Exception:
            return False
    legacy = getattr(dist, f"is_{name}_available", None)
    return bool(legacy()) if legacy is not None else name in getattr(dist.Backend, "backend_list", [])


def _section_distributed(ctx: _Context, r: SectionResult) -> None:
    if ctx.torch is None:
        ctx.no_target(r)
        return
    import datetime

    import torch.distributed as dist

    if not dist.is_available():
        r.worse("fail")
        r.details.append("torch.distributed is not available in this torch build")
        r.fixes.append("install a torch build with distributed support")
        return
    available = {name: _backend_available(dist, name) for name in ("gloo", "nccl", "hccl")}
    r.data["backends"] = available
    r.details.append("backends: " + ", ".join(f"{k} {'yes' if v else 'no'}"
                                              for k, v in available.items()))
    if ctx.no_target(r):
        return
    backend = npu.dist_backend_for(ctx.target)
    r.data["backend"] = backend
    if not available[backend]:
        r.worse("fail")
        r.details.append(f"{backend} (for {ctx.target.type}) is not available")
        r.fixes.append({
            "hccl": "HCCL backend not registered — `import torch_npu` before "
                    "init_process_group(backend='hccl') (seed §7.3, §10.2)",
            "nccl": "NCCL backend missing — install a CUDA build of torch with NCCL",
            "gloo": "gloo backend missing — install a standard torch build",
        }[backend])
        return
    if dist.is_initialized():
        r.details.append(f"a process group is already initialized ({dist.get_backend()}): "
                         "1-process init skipped")
        return
    with tempfile.TemporaryDirectory(prefix="npu-parity-doctor-") as tmp:
        start = time.perf_counter()
        try:
            if ctx.target.type in ("npu", "cuda"):
                getattr(ctx.torch, ctx.target.type).set_device(ctx.target.index or 0)
            dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=0,
                                    world_size=1, timeout=datetime.timedelta(seconds=60))
            try:
                value = ctx.torch.ones(4, device=ctx.target)
                dist.all_reduce(value)
                ok = bool((value.cpu() == 1).all())
            finally:
                destroy_process_groups()  # torch 2.5.1's gloo destructor can deadlock (process_group)
        except Exception as exc:
            r.worse("fail")
            r.details.append(f"1-process {backend} init on {ctx.target}: FAILED — "
                             f"{npu._first_line(exc)}")
            r.fixes.append(f"init_process_group('{backend}') fails on {ctx.target}: "
                           f"{npu._first_line(exc)} — check the version matrix and, for hccl, "
                           "HCCL_* environment variables")
            return
        seconds = time.perf_counter() - start
    r.data.update(init_ok=ok, init_s=seconds)
    if ok:
        r.details.append(f"1-process {backend} init + all_reduce on {ctx.target}: ok ({seconds:.2f} s)")
    else:
        r.worse("fail")
        r.details.append(f"1-process {backend} all_reduce on {ctx.target} returned a wrong value")
        r.fixes.append(f"{backend} all_reduce with world size 1 changed its input — the "
                       "collective library is broken")


#: The Ascend adapter package of Gitee's ``ascend/DeepSpeed`` (imported as ``deepspeed_npu`` beside a stock
#: DeepSpeed); stock DeepSpeed ships its own ``accelerator/npu_accelerator.py``.
DEEPSPEED_NPU_ADAPTER = "deepspeed_npu"


def deepspeed_accelerator() -> dict[str, Any]:
    """Which accelerator DeepSpeed picks in this process and the collective backend it will use.

    Calls ``deepspeed.accelerator.get_accelerator()`` (importing DeepSpeed). In DeepSpeed 0.19.8
    (``deepspeed/accelerator/real_accelerator.py``) the choice is ``DS_ACCELERATOR`` when set (``npu``
    requires ``import torch_npu`` to succeed, else ``ValueError``), otherwise auto-detection in the order
    xpu, **npu (``import torch_npu`` succeeds)**, sdaa, mps, hpu, mlu, supa, klxpu, cuda, cpu. The backend is
    ``communication_backend_name()`` — what ``deepspeed.initialize`` and ``DeepSpeedEngine`` pass to
    ``init_distributed``: ``hccl`` for ``NPU_Accelerator``, ``nccl`` for CUDA, ``ccl`` or ``gloo`` for the CPU
    (``ccl`` only with oneCCL's ``oneccl_bindings_for_pytorch``). A ``communication_backend`` key in the JSON
    config plays no part (see ``deepspeed_config``).

    Returns:
        ``{"accelerator": "npu", "backend": "hccl", "chosen_by": "auto-detect" | "DS_ACCELERATOR",
        "error": None}``; on failure ``accelerator``/``backend`` are None and ``error`` is one line.
    """
    import contextlib

    chosen_by = "DS_ACCELERATOR" if "DS_ACCELERATOR" in os.environ else "auto-detect"
    try:
        # DeepSpeed's logger (deepspeed/utils/logging.py) writes to the sys.stdout of its import time and
        # get_accelerator() logs its choice: stdout is kept for the report (``--json``), the log goes to stderr.
        with contextlib.redirect_stdout(sys.stderr):
            from deepspeed.accelerator import get_accelerator

            accelerator = get_accelerator()
        return {"accelerator": str(accelerator.device_name()), "backend": str(accelerator.communication_backend_name()),
                "chosen_by": chosen_by, "error": None}
    except Exception as exc:  # noqa: BLE001 - an import or detection failure is the finding itself
        return {"accelerator": None, "backend": None, "chosen_by": chosen_by, "error": npu._first_line(exc)}


def _section_deepspeed(ctx: _Context, r: SectionResult) -> None:
    spec = npu._find_spec("deepspeed")
    adapter = npu._find_spec(DEEPSPEED_NPU_ADAPTER) is not None
    ds_env = os.environ.get("DS_ACCELERATOR")
    r.data.update(installed=spec is not None, deepspeed_npu=adapter, ds_accelerator=ds_env)
    if ctx.deepspeed_findings is not None:
        _deepspeed_lint(ctx, r)
    on_npu = ctx.target is not None and ctx.target.type == "npu"
    if spec is None:
        if ctx.deepspeed_findings is None:  # nothing checked at all (a clean lint stays ok)
            r.status = "skip"
        r.details.append("DeepSpeed not installed (needed only for DeepSpeed training)")
        if on_npu:
            r.fixes.append("for DeepSpeed on Ascend: pip install deepspeed (its NPU accelerator uses HCCL when "
                           "torch_npu imports), then rerun the doctor")
        return
    version = _version("deepspeed")
    locations = list(spec.submodule_search_locations or [])
    npu_accelerator = any(os.path.isfile(os.path.join(loc, "accelerator", "npu_accelerator.py"))
                          for loc in locations)
    build = (f"stock DeepSpeed with Ascend's {DEEPSPEED_NPU_ADAPTER} adapter" if adapter
             else "stock DeepSpeed" + (" (ships accelerator/npu_accelerator.py)" if npu_accelerator
                                       else " without an NPU accelerator"))
    r.data.update(version=version, npu_accelerator=npu_accelerator, build=build)
    r.details.append(f"deepspeed {version} ({locations[0] if locations else spec.origin}): {build}")
    info = deepspeed_accelerator()
    r.data.update(info)
    r.data["uses_hccl"] = info["backend"] == "hccl"
    if info["error"]:
        r.worse("fail" if on_npu or ds_env else "warn")
        r.details.append(f"deepspeed.accelerator.get_accelerator() failed: {info['error']}")
        r.fixes.append(f"DeepSpeed cannot choose its accelerator ({info['error']})"
                       + (" — DS_ACCELERATOR=npu needs an importable torch_npu: fix torch_npu (environment "
                          "section) or unset DS_ACCELERATOR" if ds_env == "npu" else
                          " — fix the DeepSpeed installation (pip install --force-reinstall deepspeed)"))
        return
    why = (f"DS_ACCELERATOR={ds_env}" if info["chosen_by"] == "DS_ACCELERATOR" else
           "auto-detected: torch_npu imports" if info["accelerator"] == "npu" else
           "auto-detected" + ("" if not (ctx.status and ctx.status.torch_npu_version) else
                              ": torch_npu is installed but does not import"))
    r.details.append(f"accelerator: {info['accelerator']} ({why}) → communication backend {info['backend']}: "
                     + ("DeepSpeed will use HCCL" if info["backend"] == "hccl" else "DeepSpeed will not use HCCL"))
    if on_npu and info["accelerator"] != "npu":
        r.worse("fail")
        cause = (f"DS_ACCELERATOR={ds_env} overrides the NPU — set DS_ACCELERATOR=npu or unset it"
                 if ds_env else "torch_npu does not import in this process — see the environment section, or "
                 "set DS_ACCELERATOR=npu to see the import error")
        r.fixes.append(f"DeepSpeed picked the {info['accelerator']} accelerator and will initialize "
                       f"{info['backend']}, not HCCL, on an NPU target: {cause}")


def _deepspeed_lint(ctx: _Context, r: SectionResult) -> None:
    """The ``--deepspeed-config`` findings (``deepspeed_config.lint_file``) as details and fixes."""
    findings = ctx.deepspeed_findings or []
    r.data["config"] = ctx.deepspeed_config
    r.data["config_findings"] = [f.as_dict() for f in findings]
    if not findings:
        r.details.append(f"config {ctx.deepspeed_config}: follows the guide's rules (bf16 on, fp16 off, no "
                         "communication_backend, no aio)")
        return
    errors = sum(f.severity == "error" for f in findings)
    r.details.append(f"config {ctx.deepspeed_config}: {errors} error(s), {len(findings) - errors} warning(s)")
    r.worse("fail" if errors else "warn")
    r.fixes.extend(f.message for f in findings)


def _section_precision(ctx: _Context, r: SectionResult) -> None:
    if ctx.torch is None:
        ctx.no_target(r)
        return
    flags = npu.precision_flags()
    r.data["flags"] = flags
    r.details.extend(f"{k} = {v}" for k, v in flags.items())
    kind = ctx.target.type if ctx.target is not None else None
    reduced: list[str] = []
    if kind == "cuda":
        reduced = [k for k in ("cuda.matmul.allow_tf32", "cudnn.allow_tf32") if flags.get(k)]
        if flags.get("float32_matmul_precision") != "highest":
            reduced.append(f"float32_matmul_precision={flags['float32_matmul_precision']}")
    elif kind == "npu":
        reduced = [k for k in ("npu.matmul.allow_hf32", "npu.conv.allow_hf32") if flags.get(k)]
    elif kind == "cpu":
        r.details.append("target is the CPU: TF32/HF32 switches have no effect there"
                         + ("" if "npu.conv.allow_hf32" in flags else "; no NPU: HF32 flags absent"))
    r.data["reduced_precision_on_target"] = reduced
    if reduced:
        r.worse("warn")
        off = {"npu.conv.allow_hf32": "torch.npu.conv.allow_hf32 = False",
               "npu.matmul.allow_hf32": "torch.npu.matmul.allow_hf32 = False",
               "cuda.matmul.allow_tf32": "torch.backends.cuda.matmul.allow_tf32 = False",
               "cudnn.allow_tf32": "torch.backends.cudnn.allow_tf32 = False"}
        fixes = [off.get(k, "torch.set_float32_matmul_precision('highest')") for k in reduced]
        r.fixes.append(f"{', '.join(reduced)} on {ctx.target}: fp32 runs with 10-bit mantissas "
                       f"there — parity checks of the fp32 recipe switch this off for their "
                       f"duration; for your own fp32 runs set {'; '.join(fixes)}")


#: The engine's section functions (the adapters' come from ``adapters.discover()``).
_SECTION_FUNCS: dict[str, Callable[[DoctorContext, SectionResult], None]] = {
    "environment": _section_environment,
    "devices": _section_devices,
    "required_ops": _section_required_ops,
    "optional_ops": _section_optional_ops,
    "distributed": _section_distributed,
    "deepspeed": _section_deepspeed,
    "precision": _section_precision,
}

# ---------------------------------------------------------------------------------------------
# Runner
# ---------------------------------------------------------------------------------------------

_DEVICE_SPEC = re.compile(r"^(auto|cpu|cuda|npu)(?::(\d+))?$")


def _build_context(device: str) -> _Context:
    ctx = _Context(requested=device)
    try:
        # A torch_npu that cannot load is diagnosed once and quarantined, so that the sections that
        # import transformers/aurora (patch set, smoke test) report their own state, not its failure.
        npu.prepare_torch()
        ctx.torch = npu.import_torch()
    except Exception as exc:
        ctx.torch_error = (npu.explain_import_error(exc) if "torch_npu" in str(exc)
                           or "backend extension" in str(exc)
                           else f"torch is not importable: {npu._first_line(exc)} — reinstall torch")
    ctx.status = npu.npu_status()
    if ctx.torch is None:
        return ctx
    try:
        from .devices import resolve_target

        ctx.target = resolve_target(device, option="--device")
    except ValueError:
        raise
    except Exception as exc:  # DeviceUnavailableError: one sentence with the fix
        ctx.target_error = str(exc)
        return ctx
    try:
        # As the guide's launcher (seed §4.2), before the patch-set and smoke sections import aurora;
        # a CPU/CUDA target: nothing.
        ctx.launch = npu.launch(ctx.target)
    except Exception as exc:  # noqa: BLE001 - reported in the devices section
        ctx.launch_error = npu._first_line(exc)
    return ctx


def run_doctor(device: str = "auto", *, skip: tuple[str, ...] = (),
               deepspeed_config: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Run every section against ``device`` and return the report (the ``--json`` document).

    Args:
        device: ``auto``, ``cpu``, ``cuda``, ``cuda:N``, ``npu`` or ``npu:N``.
        skip: section names to leave out (reported with status ``skip``).
        deepspeed_config: a DeepSpeed JSON config to lint by the guide's rules
            (``deepspeed_config.lint_file``); its findings go into the ``deepspeed`` section (an error
            fails it, a warning warns), also when that section is skipped.

    Returns:
        A dict that validates against ``DOCTOR_JSON_SCHEMA``; ``summary.exit_code`` is 0 when no
        section failed, else 1. A section that raises is reported as ``fail`` with the error.

    Raises:
        ValueError: ``device`` is not a device spec, or ``skip`` names an unknown section.
        deepspeed_config.DeepSpeedConfigError: ``deepspeed_config`` is missing or not a JSON object
            (checked before any section runs).
    """
    spec = device.strip().lower()
    if not _DEVICE_SPEC.match(spec) or spec.startswith("auto:"):
        raise ValueError(f"--device={device!r} is not a device: use auto, cpu, cuda, cuda:N, npu "
                         "or npu:N")
    known = sections()
    unknown = [s for s in skip if s not in known]
    if unknown:
        raise ValueError(f"--skip: unknown section(s) {', '.join(unknown)}; known: "
                         f"{', '.join(known)}")
    findings = None
    if deepspeed_config is not None:
        from .deepspeed_config import lint_file

        findings = lint_file(deepspeed_config)  # a missing or broken file stops here, before any section
    started = time.perf_counter()
    ctx = _build_context(spec)
    ctx.deepspeed_config, ctx.deepspeed_findings = (str(deepspeed_config) if deepspeed_config is not None
                                                    else None), findings
    results: list[SectionResult] = []
    funcs = {s.name: s.run for s in _adapter_sections()}
    for name in known:
        func = _SECTION_FUNCS[name] if name in ENGINE_SECTIONS else funcs[name]
        result = SectionResult(name)
        start = time.perf_counter()
        if name in skip:
            result.status = "skip"
            result.details.append("skipped: --skip " + name)
            if name == "deepspeed" and findings is not None:
                _deepspeed_lint(ctx, result)  # the lint asked for is reported whatever else is skipped
        else:
            try:
                func(ctx, result)
            except Exception as exc:  # a broken section must not hide the others
                result.worse("fail")
                result.details.append(f"section raised {npu._first_line(exc)}")
                result.fixes.append(f"the {name} check itself failed ({npu._first_line(exc)}) — "
                                    "rerun with --json and report it with the output")
        result.duration_s = time.perf_counter() - start
        results.append(result)
    counts = {s: sum(r.status == s for r in results) for s in STATUSES}
    failing = [r.name for r in results if r.status == "fail"]
    exit_code = EXIT_FAIL if failing else EXIT_OK
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": "pytest-npu-parity doctor",
        "tool_version": _version("pytest-npu-parity"),
        "requested_device": spec,
        "target": str(ctx.target) if ctx.target is not None else None,
        "target_error": ctx.target_error or (ctx.torch_error if ctx.torch is None else None),
        "sections": [r.as_json() for r in results],
        "summary": {
            "status": "fail" if failing else ("warn" if counts["warn"] else "ok"),
            "exit_code": exit_code,
            "counts": counts,
            "failing_sections": failing,
            "duration_s": round(time.perf_counter() - started, 3),
        },
    }


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


def _parser() -> argparse.ArgumentParser:
    known = sections()
    parser = argparse.ArgumentParser(
        prog="python -m pytest_npu_parity doctor",
        description="Check torch / torch_npu / CANN, the target device, ops, the installed model adapters' "
                    "sections (Aurora: its patch set and a smoke test), distributed backends and precision "
                    "flags before trusting a parity number.",
        epilog="exit codes: 0 no section failed (warn/skip allowed), 1 a section failed, "
               "2 usage error",
    )
    parser.add_argument("--device", default="auto",
                        help="target: auto (npu > cuda > cpu), npu, npu:N, cuda, cuda:N or cpu "
                             "(default: auto)")
    parser.add_argument("--json", action="store_true",
                        help="print the report as JSON (schema: pytest_npu_parity.doctor."
                             "DOCTOR_JSON_SCHEMA)")
    parser.add_argument("--skip", action="append", default=[], choices=list(known),
                        metavar="SECTION",
                        help=f"leave a section out (repeatable): {', '.join(known)}")
    parser.add_argument("--deepspeed-config", metavar="FILE", default=None,
                        help="lint this DeepSpeed JSON config by the Ascend guide's rules (bf16 on, fp16 off, "
                             "no communication_backend, no aio); findings go into the DeepSpeed section. "
                             "Lint alone: add --skip for every other section")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``doctor``; returns the exit code (0 ok, 1 a section failed, 2 usage)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse: --help → 0, bad option → 2
        return int(exc.code or 0)
    try:
        report = run_doctor(args.device, skip=tuple(args.skip), deepspeed_config=args.deepspeed_config)
    except ValueError as exc:  # also deepspeed_config.DeepSpeedConfigError: one sentence naming the file
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(report, indent=2, allow_nan=False))
    else:
        print(render_text(report))
    return int(report["summary"]["exit_code"])
