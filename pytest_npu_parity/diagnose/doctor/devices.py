"""The ``devices`` section: the target and its launcher steps, visible NPUs and CUDA devices,
``npu-smi info`` (:func:`parse_npu_smi`), device memory and the host.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import Any

from ...runtime import npu
from ...runtime.npu import troubleshoot
from ...runtime.npu.diagnosis import _first_line
from .report import SectionResult, _Context, _gib

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

    _npu_smi(r, status)
    if status and status.available and torch is not None:
        _npu_memory(torch, r, status)
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


def _npu_smi(r: SectionResult, status: npu.NpuStatus | None) -> None:
    """``npu-smi info``: each NPU's health and HBM, and whether torch can use the NPUs it sees."""
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


def _npu_memory(torch: Any, r: SectionResult, status: npu.NpuStatus) -> None:
    """Free and total memory of each usable NPU (``torch.npu.mem_get_info``)."""
    memory = []
    for index in range(status.device_count):
        try:
            free, total = torch.npu.mem_get_info(index)
            memory.append({"npu": index, "free_bytes": int(free), "total_bytes": int(total)})
        except Exception as exc:  # driver quirks must not stop the report
            memory.append({"npu": index, "error": _first_line(exc)})
    _mem_get_info_fallback(r, memory)
    for m in memory:
        if "error" not in m:
            r.details.append(f"npu:{m['npu']} memory: {_gib(m['free_bytes'])} free of "
                             f"{_gib(m['total_bytes'])}")
    r.data["npu_memory"] = memory


def _mem_get_info_fallback(r: SectionResult, memory: list[dict[str, Any]]) -> None:
    """Checklist §3.4: a ``torch.npu.mem_get_info`` that raised warns, naming the fallback."""
    for m in memory:
        if "error" in m:
            r.worse("warn")
            r.fixes.append(troubleshoot.mem_get_info_fallback(f"npu:{m['npu']}", m["error"]))
