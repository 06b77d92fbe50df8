"""The Aurora adapter's part of ``python -m pytest_npu_parity doctor``.

Registered through the adapter seam (``pytest_npu_parity.adapters``; the adapter object is
``pytest_npu_parity.aurora.adapter.ADAPTER``), so the doctor prints these only where the Aurora
adapter is installed or named:

==================  ================================================================================
section             checks
==================  ================================================================================
environment lines   transformers and aurora-model versions (transformers 5.x cannot import
                    aurora-model 0.2.0) — :func:`environment_facts`
``patch_set``       self-test of the patch set: a mini patch embedding (``nn.Linear`` on the target
                    + FFT frequency masking, also with the forced CPU FFT fallback) keeps every
                    tensor on the device; upstream is restored on exit
``aurora_smoke``    the tiny Aurora config runs a forward on the target under the patch set
==================  ================================================================================

Importing this module does not import ``aurora``: the smoke test builds the model when it runs
(an ImportError there, aurora-model missing, skips the section with the install command).
"""
from __future__ import annotations

import sys
import time
from typing import Any

from pytest_npu_parity.aurora import factory, inputs, patches
from pytest_npu_parity.diagnose.doctor.report import DoctorContext, SectionResult, version_of
from pytest_npu_parity.runtime import npu
from pytest_npu_parity.runtime.npu.diagnosis import _first_line

__all__ = ["environment_facts", "section_aurora_smoke", "section_patch_set"]


def environment_facts(r: SectionResult) -> dict[str, Any]:
    """The environment section's Aurora lines: the transformers and aurora-model versions, a warning
    when aurora-model is missing or transformers is 5.x (it cannot import aurora-model 0.2.0).

    Returns:
        ``{"transformers": version or None, "aurora_model": version or None}`` for the section's data.
    """
    transformers_version = version_of("transformers")
    aurora_version = version_of("aurora-model")
    r.details.append(f"transformers {transformers_version or 'not installed'}")
    r.details.append(f"aurora-model {aurora_version or 'not installed'}")
    if aurora_version is None:
        r.worse("warn")
        r.fixes.append("aurora-model is not installed: the Aurora suite and smoke test cannot run — "
                       "pip install 'pytest-npu-parity[aurora]'")
    if transformers_version and int((npu.base_version(transformers_version) or "0").split(".")[0]) >= 5:
        r.worse("warn")
        r.fixes.append(f"transformers {transformers_version} cannot import aurora-model 0.2.0 "
                       "(its huggingface_hub pin) — pip install 'transformers>=4.50,<5'")
    return {"transformers": transformers_version, "aurora_model": aurora_version}


def _mini_patch_embedding(torch: Any, patch_len: int = 8, d_model: int = 16) -> Any:
    """A stand-in for Aurora's patch embedding: FFT frequency masking then ``nn.Linear`` patches.

    Input ``(batch, length)`` fp32 with ``length % patch_len == 0``; output
    ``(batch, length // patch_len, d_model)``. ``devices`` records where each intermediate lives.
    """

    class MiniPatchEmbedding(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(patch_len, d_model)
            self.devices: dict[str, str] = {}

        def forward(self, x: Any) -> Any:
            spectrum = torch.fft.rfft(x, dim=-1)
            keep = torch.arange(spectrum.shape[-1], device=x.device) < spectrum.shape[-1] // 2
            smooth = torch.fft.irfft(spectrum * keep, n=x.shape[-1], dim=-1)
            patches = smooth.unfold(-1, patch_len, patch_len)
            out = self.proj(patches)
            self.devices = {"rfft": str(spectrum.device), "irfft": str(smooth.device),
                            "linear": str(out.device)}
            return out

    return MiniPatchEmbedding()


def section_patch_set(ctx: DoctorContext, r: SectionResult) -> None:
    """Doctor section ``patch_set``: the patch set keeps a mini patch embedding on the target (probed
    FFT route and forced CPU FFT fallback) and restores ``torch.fft`` on exit."""
    if ctx.no_target(r):
        return
    torch = ctx.torch
    torch.manual_seed(0)
    module = _mini_patch_embedding(torch)
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = module(x)
    target_type = ctx.target.type
    original = (torch.fft.rfft, torch.fft.irfft)
    variants = {"probed FFT route": None, "forced CPU FFT fallback": True}
    r.data["variants"] = {}
    for label, fft_fallback in variants.items():
        try:
            with patches.patched(ctx.target, fft_fallback=fft_fallback) as patch_set:
                moved = module.to(ctx.target)
                with torch.no_grad():
                    out = moved(x.to(ctx.target))
                host = out.cpu()
                applied = list(patch_set.applied)
        except Exception as exc:
            r.worse("fail")
            r.details.append(f"{label}: FAILED — {_first_line(exc)}")
            r.fixes.append(f"the mini patch embedding fails on {ctx.target} under the patch set "
                           f"({label}): {_first_line(exc)} — see seed §5.3/§10.1")
            r.data["variants"][label] = {"ok": False, "error": _first_line(exc)}
            continue
        finally:
            module.to("cpu")
        off_device = {k: v for k, v in module.devices.items()
                      if torch.device(v).type != target_type}
        diff = float((host - reference).abs().max())
        close = torch.allclose(host, reference, rtol=5e-3, atol=5e-3)
        ok = not off_device and close and torch.device(str(out.device)).type == target_type
        r.data["variants"][label] = {"ok": ok, "devices": dict(module.devices),
                                     "max_abs_diff": diff, "patches": applied}
        if ok:
            r.details.append(f"{label}: every tensor on {ctx.target} "
                             f"({', '.join(f'{k}→{v}' for k, v in module.devices.items())}); "
                             f"max |target - cpu| {diff:.2g}")
        else:
            r.worse("fail")
            where = ", ".join(f"{k} on {v}" for k, v in off_device.items()) or "none"
            r.details.append(f"{label}: FAILED — tensors off the target: {where}; "
                             f"max |target - cpu| {diff:.2g}")
            r.fixes.append(f"the patch set leaves tensors off {ctx.target} or changes values "
                           f"({label}) — device propagation is broken; see seed §10.1")
    restored = (torch.fft.rfft, torch.fft.irfft) == original
    r.data["restored"] = restored
    if restored:
        r.details.append("patch set reverted: torch.fft.rfft/irfft are upstream's again")
    else:
        r.worse("fail")
        r.details.append("patch set NOT reverted: torch.fft functions are still replaced")
        r.fixes.append("the patch set did not restore torch.fft on exit — report this as a bug "
                       "in pytest_npu_parity.aurora.patches")
    if target_type == "cpu":
        r.details.append("target is the CPU: the CPU FFT fallback is a no-op here")


def section_aurora_smoke(ctx: DoctorContext, r: SectionResult) -> None:
    """Doctor section ``aurora_smoke``: the tiny seeded Aurora runs a forward on the target under the
    patch set; the output must be on the target, finite and close to the CPU's."""
    if ctx.no_target(r):
        return
    torch = ctx.torch
    start = time.perf_counter()
    try:
        model = factory.build_model("tiny", seed=0)
        batch = inputs.make_batch(batch=2, context=96, horizons=(48,))
    except ImportError as exc:
        r.status = "skip"
        r.details.append(f"skipped: {exc} — pip install 'pytest-npu-parity[aurora]'")
        return
    build_s = time.perf_counter() - start
    torch.manual_seed(0)  # FlowLoss.sample draws its noise from the CPU generator
    with torch.no_grad():
        ref_out = _first_tensor(model(**batch.forward_kwargs(48)))
    try:
        with patches.patched(ctx.target):
            model.to(ctx.target)
            kwargs = batch.to(ctx.target).forward_kwargs(48)
            torch.manual_seed(0)
            start = time.perf_counter()
            with torch.no_grad():
                out = _first_tensor(model(**kwargs))
            host = out.cpu()
            forward_s = time.perf_counter() - start
    except Exception as exc:
        r.worse("fail")
        r.details.append(f"tiny Aurora forward on {ctx.target}: FAILED — {_first_line(exc)}")
        r.fixes.append(f"the tiny Aurora forward fails on {ctx.target} under the patch set "
                       f"({_first_line(exc)}) — fix the failing ops above first, then run the "
                       "parity suite to localize the first bad module")
        return
    finally:
        model.to("cpu")
    finite = bool(torch.isfinite(host).all())
    diff = float((host.double() - ref_out.double()).abs().max())
    scale = float(ref_out.double().abs().max()) or 1.0
    r.data.update(build_s=build_s, forward_s=forward_s, output_shape=list(host.shape),
                  output_device=str(out.device), finite=finite, max_abs_diff=diff,
                  max_abs_reference=scale)
    r.details.append(f"tiny Aurora (seed 0) and 2 CO2 windows (context 96, horizon 48) built in "
                     f"{build_s:.2f} s; forward on {out.device} under the patch set in "
                     f"{forward_s:.2f} s, output {tuple(host.shape)}")
    r.details.append(f"max |target - cpu| {diff:.2g} (max |cpu| {scale:.2g})")
    if out.device.type != ctx.target.type or not finite:
        r.worse("fail")
        r.fixes.append(f"the tiny Aurora forward on {ctx.target} gives "
                       f"{'non-finite values' if not finite else f'output on {out.device}'} — "
                       "run the parity suite to localize the first bad module")
    elif diff > 5e-3 * scale + 5e-3:  # the HF32/TF32 budget of npu.probe_ops, relative to |output|
        r.worse("warn")
        r.fixes.append(f"the tiny Aurora forward on {ctx.target} differs from the CPU by {diff:.2g} "
                       "— run the parity suite (fp32 recipe) to find where")


def _first_tensor(output: Any) -> Any:
    """The first tensor of a model output (tensor, tuple/list, dict or HF ModelOutput)."""
    torch = sys.modules["torch"]
    if isinstance(output, torch.Tensor):
        return output
    values = output.values() if hasattr(output, "values") else output
    for value in values:
        if isinstance(value, torch.Tensor):
            return value
    raise TypeError(f"model output {type(output).__name__} holds no tensor")
