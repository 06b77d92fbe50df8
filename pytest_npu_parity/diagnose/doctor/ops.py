"""The ``required_ops`` and ``optional_ops`` sections: op probes on the target against the CPU."""
from __future__ import annotations

import dataclasses

from ...runtime import npu
from .report import SectionResult, _Context

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
