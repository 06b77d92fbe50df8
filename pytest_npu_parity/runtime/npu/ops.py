"""Op probes: small ops run on a device and compared with the CPU.

The doctor uses ``probe_ops``; ``needs_fft_fallback`` uses it to decide whether the patch set must
run FFTs on the CPU.
"""
from __future__ import annotations

import dataclasses
import math
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable

from .diagnosis import _first_line
from .loading import import_torch

if TYPE_CHECKING:  # torch is imported lazily at run time
    import torch

#: Tolerance for fp32 ops without long reductions. Loose on purpose: a probe asks "does the op run
#: on the target and compute the same function", not "is it bit-for-bit parity" (that is the
#: suite's job). 1e-3 is torch_npu's own ``assertRtolEqual`` default (DESIGN anchors).
_TOL_ELEMENTWISE = (1e-3, 1e-3)
#: Tolerance for fp32 ops with inner products (linear, matmul, SDPA, conv, einsum, FFT, pinv):
#: 10× the unit roundoff of HF32/TF32 (10 explicit mantissa bits → 2**-11 ≈ 4.9e-4), because
#: torch_npu runs conv in HF32 by default and CUDA may run matmuls in TF32.
_TOL_REDUCTION = (5e-3, 5e-3)
#: Tolerance for bf16: ``torch.testing.assert_close``'s bf16 rtol (1.6e-2 ≈ 2 bf16 ulps), atol 1e-3.
_TOL_BF16 = (1.6e-2, 1e-3)


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One op probe: CPU inputs from a seeded generator, the op, and its tolerance.

    Attributes:
        name: probe name (``"linear"``, ``"rfft"``…).
        make_inputs: ``generator -> tuple of CPU tensors`` (fp32 unless stated).
        fn: the op, applied to the inputs on the CPU and on the target.
        rtol, atol: ``torch.allclose`` tolerance of target vs CPU.
        what: one-line description for reports.
    """

    name: str
    make_inputs: Callable[[Any], tuple]
    fn: Callable[..., Any]
    rtol: float
    atol: float
    what: str


@dataclasses.dataclass(frozen=True)
class OpProbe:
    """Result of probing one op on a device.

    Attributes:
        name: probe name.
        ok: ran on the device, the output stayed on the device, and allclose to the CPU result.
        ran: the op ran on the device without raising.
        max_abs_diff: max |target − CPU| over the output (complex outputs as real pairs), or None.
        rtol, atol: tolerance used.
        output_device: device of the target output (e.g. ``"npu:0"``), or None.
        error: first line of the exception, or why the comparison failed; None when ok.
        seconds: wall time of the target run including the copy back to the host.
    """

    name: str
    ok: bool
    ran: bool
    max_abs_diff: float | None
    rtol: float
    atol: float
    output_device: str | None
    error: str | None
    seconds: float


def _op_specs() -> dict[str, OpSpec]:
    torch = import_torch()
    F = torch.nn.functional

    def randn(*shape):
        return lambda g: torch.randn(*shape, generator=g)

    def inputs(*makers):
        return lambda g: tuple(m(g) for m in makers)

    def complex_spectrum(g):
        return (torch.fft.rfft(torch.randn(2, 4, 32, generator=g), dim=-1),)

    def well_conditioned(g):
        return (torch.randn(16, 12, generator=g) + 3 * torch.eye(16, 12),)

    specs = [
        OpSpec("linear", inputs(randn(4, 32), randn(16, 32), randn(16)),
               lambda x, w, b: F.linear(x, w, b), *_TOL_REDUCTION, "F.linear (nn.Linear)"),
        OpSpec("matmul", inputs(randn(4, 8, 32), randn(32, 16)),
               lambda a, b: a @ b, *_TOL_REDUCTION, "batched matmul"),
        OpSpec("sdpa", inputs(randn(2, 4, 8, 16), randn(2, 4, 8, 16), randn(2, 4, 8, 16)),
               lambda q, k, v: F.scaled_dot_product_attention(q, k, v), *_TOL_REDUCTION,
               "F.scaled_dot_product_attention (nn.Transformer layers)"),
        OpSpec("layer_norm", inputs(randn(4, 32), randn(32), randn(32)),
               lambda x, w, b: F.layer_norm(x, (32,), w, b), *_TOL_ELEMENTWISE, "F.layer_norm"),
        OpSpec("softmax", inputs(randn(4, 8, 16)), lambda x: F.softmax(x, dim=-1),
               *_TOL_ELEMENTWISE, "F.softmax"),
        OpSpec("gelu", inputs(randn(4, 32)), F.gelu, *_TOL_ELEMENTWISE, "F.gelu (ViT, BERT)"),
        OpSpec("silu", inputs(randn(4, 32)), F.silu, *_TOL_ELEMENTWISE, "F.silu (Aurora MLPs)"),
        OpSpec("batch_norm", inputs(randn(8, 16, 10), randn(16), randn(16)),
               lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True),
               *_TOL_ELEMENTWISE, "F.batch_norm, batch statistics (nn.BatchNorm1d in train mode)"),
        OpSpec("conv2d", inputs(randn(1, 3, 16, 16), randn(8, 3, 4, 4)),
               lambda x, w: F.conv2d(x, w, stride=4), *_TOL_REDUCTION,
               "F.conv2d with stride = kernel (ViT patch embedding)"),
        OpSpec("einsum", inputs(randn(2, 2, 4, 6), randn(6, 5), randn(2, 2, 3, 5)),
               lambda a, w, b: torch.einsum("bhik,kl,bhjl->bhij", a, w, b), *_TOL_REDUCTION,
               "torch.einsum (Aurora guided attention bias)"),
        OpSpec("topk", inputs(randn(4, 33)), lambda x: torch.topk(x, 3, dim=-1).values,
               *_TOL_ELEMENTWISE, "torch.topk values (Aurora period search)"),
        OpSpec("interpolate", inputs(randn(1, 4, 10)),
               lambda x: F.interpolate(x, size=16, mode="linear"), *_TOL_ELEMENTWISE,
               "F.interpolate(mode='linear') (Aurora resample)"),
        OpSpec("sin_cos_exp", inputs(randn(4, 32)),
               lambda x: torch.cat([torch.sin(x), torch.cos(x), torch.exp(-x.abs())], dim=-1),
               *_TOL_ELEMENTWISE, "sin/cos/exp/cat (timestep embedding)"),
        OpSpec("rfft", inputs(randn(2, 4, 32)), lambda x: torch.fft.rfft(x, dim=-1),
               *_TOL_REDUCTION, "torch.fft.rfft, fp32 (needs CANN >= 8.2 on NPU, seed §5.3)"),
        OpSpec("irfft", complex_spectrum, lambda s: torch.fft.irfft(s, n=32, dim=-1),
               *_TOL_REDUCTION, "torch.fft.irfft, fp32 (needs CANN >= 8.2 on NPU, seed §5.3)"),
        OpSpec("pinv", well_conditioned, torch.linalg.pinv, *_TOL_REDUCTION,
               "torch.linalg.pinv (Aurora patch-size resample)"),
        OpSpec("linear_bf16", lambda g: tuple(t.to(torch.bfloat16) for t in
                                              (torch.randn(4, 32, generator=g),
                                               torch.randn(16, 32, generator=g))),
               lambda x, w: F.linear(x, w), *_TOL_BF16, "F.linear in bfloat16 (bf16 recipes)"),
    ]
    return {s.name: s for s in specs}


#: Ops every Aurora forward needs on the target (an NPU port without them cannot run).
REQUIRED_OPS: tuple[str, ...] = ("linear", "matmul", "sdpa", "layer_norm", "softmax", "gelu",
                                 "silu", "batch_norm", "conv2d", "einsum", "topk", "interpolate",
                                 "sin_cos_exp")
#: Ops the patch set can move to the CPU when the target lacks them (FFT, pinv), plus bf16 support.
OPTIONAL_OPS: tuple[str, ...] = ("rfft", "irfft", "pinv", "linear_bf16")


def _as_real(t: Any) -> Any:
    torch = sys.modules["torch"]
    return torch.view_as_real(t) if t.is_complex() else t


def probe_ops(device: "torch.device | str", ops: Iterable[str] = REQUIRED_OPS + OPTIONAL_OPS,
              *, seed: int = 0) -> dict[str, OpProbe]:
    """Run each op on ``device`` and compare it with the same op on the CPU.

    Inputs are small (≤ 2·4·8·16 elements), drawn on the CPU from ``torch.Generator`` seeded with
    ``seed`` and copied to the device; the CPU result is the reference. An op passes when it runs,
    its output lies on ``device``'s type, and ``torch.allclose(target.cpu(), cpu, rtol, atol)``
    (tolerances per op, see ``_TOL_*``). On ``device="cpu"`` the comparison is CPU with itself, so
    it checks only that each op runs.

    Args:
        device: target device (``torch.device`` or string such as ``"npu:0"``).
        ops: probe names, a subset of ``REQUIRED_OPS + OPTIONAL_OPS``.
        seed: generator seed for the inputs.

    Returns:
        ``{name: OpProbe}`` in the order given; never raises for an op that fails on the device.

    Raises:
        ValueError: an unknown op name (the message lists the known ones) or a bad device string.
    """
    torch = import_torch()
    device = torch.device(device)
    specs = _op_specs()
    names = list(ops)
    unknown = [n for n in names if n not in specs]
    if unknown:
        raise ValueError(f"unknown op probe(s) {', '.join(unknown)}; known: {', '.join(specs)}")
    results: dict[str, OpProbe] = {}
    for name in names:
        spec = specs[name]
        generator = torch.Generator().manual_seed(seed)
        cpu_inputs = spec.make_inputs(generator)
        reference = spec.fn(*cpu_inputs)
        start = time.perf_counter()
        try:
            out = spec.fn(*(t.to(device) for t in cpu_inputs))
            out_device = str(out.device)
            host = out.cpu()
        except Exception as exc:
            results[name] = OpProbe(name, False, False, None, spec.rtol, spec.atol, None,
                                    _first_line(exc), time.perf_counter() - start)
            continue
        seconds = time.perf_counter() - start
        got, want = _as_real(host).double(), _as_real(reference).double()
        diff = float((got - want).abs().max()) if got.numel() else 0.0
        error = None
        if out.device.type != device.type:
            error = f"output on {out_device}, expected {device.type}"
        elif got.shape != want.shape:
            error = f"shape {tuple(got.shape)} on the target vs {tuple(want.shape)} on the CPU"
        elif not torch.allclose(got, want, rtol=spec.rtol, atol=spec.atol):
            error = (f"max |target - cpu| = {diff:.3g} beyond rtol={spec.rtol:g}, "
                     f"atol={spec.atol:g}")
        results[name] = OpProbe(name, error is None, True, diff if math.isfinite(diff) else None,
                                spec.rtol, spec.atol, out_device, error, seconds)
    return results


def needs_fft_fallback(device: "torch.device | str") -> bool:
    """Whether ``torch.fft.rfft``/``irfft`` must run on the CPU for ``device``.

    True when either FFT probe fails on the device (CANN < 8.2 lacks them on the NPU, seed §5.3 /
    §10.3); always False on the CPU. The patch set's ``fft_fallback`` takes this value.
    """
    torch = import_torch()
    if torch.device(device).type == "cpu":
        return False
    return not all(p.ok for p in probe_ops(device, ("rfft", "irfft")).values())
