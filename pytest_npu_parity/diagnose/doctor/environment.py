"""The ``environment`` section: Python, torch, torch_npu, CANN, the adapters' lines, the version
matrix and the guides' troubleshooting items that apply here.
"""
from __future__ import annotations

import dataclasses
import platform
import sys
from typing import Any

from ... import adapters
from ...runtime import npu
from ...runtime.npu import troubleshoot
from ...runtime.npu.cann import _looked_in
from .report import SectionResult, _Context, _version

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
                         f"{_looked_in()})")
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
