"""Running the doctor: the engine's section functions, the context every section reads
(``_build_context``), :func:`run_doctor` (the ``--json`` document) and the command line
(``_parser``, :func:`main`).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from typing import Any, Callable

from ...runtime import npu
from ...runtime.npu.diagnosis import _first_line
from .devices import _section_devices
from .distributed import _deepspeed_lint, _section_deepspeed, _section_distributed
from .environment import _section_environment
from .ops import _section_optional_ops, _section_required_ops
from .precision import _section_precision
from .report import (
    ENGINE_SECTIONS, EXIT_FAIL, EXIT_OK, EXIT_USAGE, SCHEMA_VERSION, STATUSES, DoctorContext, SectionResult,
    _adapter_sections, _Context, _version, render_text, sections,
)

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
                           else f"torch is not importable: {_first_line(exc)} — reinstall torch")
    ctx.status = npu.npu_status()
    if ctx.torch is None:
        return ctx
    try:
        from ...runtime.devices import resolve_target

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
        ctx.launch_error = _first_line(exc)
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
        from ...runtime.deepspeed_config import lint_file

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
                result.details.append(f"section raised {_first_line(exc)}")
                result.fixes.append(f"the {name} check itself failed ({_first_line(exc)}) — "
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
