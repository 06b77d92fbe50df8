"""Tests for pytest_npu_parity.aurora.patches: equality with upstream, apply/revert, device placement."""
from __future__ import annotations

import copy
import logging
import random

import pytest
import torch

pytest.importorskip("aurora")

import aurora.flow_loss as flow_mod  # noqa: E402
import aurora.modality_connector as connector_mod  # noqa: E402
import aurora.modeling_aurora as modeling  # noqa: E402
import aurora.prototype_retriever as retriever_mod  # noqa: E402
import aurora.util_functions as util  # noqa: E402
from aurora.configuration_aurora import AuroraConfig  # noqa: E402

from pytest_npu_parity.aurora import patches  # noqa: E402
from pytest_npu_parity.aurora.factory import build_model  # noqa: E402
from pytest_npu_parity.aurora.inputs import make_batch  # noqa: E402
from pytest_npu_parity.aurora.patches import (  # noqa: E402
    PatchError, apply_all_patches, causal_attention_mask, decay_weights, irfft, patched, resample, rfft,
)

# Upstream objects, captured at import time (before any test applies the patch set).
UPSTREAM = {
    (util, "resample"): util.resample,
    (modeling, "resample"): modeling.resample,
    (flow_mod, "resample"): flow_mod.resample,
    (util, "causal_attention_mask"): util.causal_attention_mask,
    (modeling, "causal_attention_mask"): modeling.causal_attention_mask,
    (retriever_mod, "causal_attention_mask"): retriever_mod.causal_attention_mask,
    (modeling.AuroraDecoderLayer, "forward"): modeling.AuroraDecoderLayer.__dict__["forward"],
    (modeling.AuroraModel, "forward"): modeling.AuroraModel.__dict__["forward"],
    (modeling.AuroraAttention, "forward"): modeling.AuroraAttention.__dict__["forward"],
    (modeling.AuroraPatchEmbedding, "_freq_masking"): modeling.AuroraPatchEmbedding.__dict__["_freq_masking"],
    (retriever_mod.Retriever, "forward"): retriever_mod.Retriever.__dict__["forward"],
    (flow_mod.SimpleMLPAdaLN, "forward"): flow_mod.SimpleMLPAdaLN.__dict__["forward"],
    (flow_mod.TimestepEmbedder, "forward"): flow_mod.TimestepEmbedder.__dict__["forward"],
    (connector_mod.TextEncoder, "extract_bert_features"): connector_mod.TextEncoder.__dict__["extract_bert_features"],
    (connector_mod.VisionEncoder, "forward"): connector_mod.VisionEncoder.__dict__["forward"],
    (torch.fft, "rfft"): torch.fft.rfft,
    (torch.fft, "irfft"): torch.fft.irfft,
}
if patches.cpu_lacks_bf16_mse():  # torch 2.5.1: the patch set adds the bf16 mse_loss upcast
    UPSTREAM[(torch.nn.functional, "mse_loss")] = torch.nn.functional.mse_loss
upstream_resample = util.resample
upstream_mask = util.causal_attention_mask
upstream_rfft = torch.fft.rfft
upstream_irfft = torch.fft.irfft

needs_cuda_build = pytest.mark.skipif(torch.version.cuda is None,
                                      reason="fake 'cuda' tensors need a CUDA build of torch")


@pytest.fixture(autouse=True)
def _no_patch_set_leaks():
    assert patches.active_patch_set() is None, "a previous test left the patch set applied"
    yield
    active = patches.active_patch_set()
    if active is not None:
        active.revert()
        pytest.fail("the test left the patch set applied")


@pytest.fixture(scope="module")
def tiny():
    return build_model("tiny", seed=0)


@pytest.fixture(scope="module")
def batch():
    return make_batch(batch=2)


def _state_is_upstream() -> bool:
    for (owner, attr), original in UPSTREAM.items():
        current = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr)
        if current is not original:
            return False
    return not hasattr(modeling, "_npu_parity_decay_weights")


# ---- resample -------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,new_len", [((32, 48), 24), ((32, 48), 96), ((16, 48), 37), ((64, 7), 48)])
def test_resample_bitwise_equal_to_upstream_fp32(shape, new_len):
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(shape, generator=gen)
    assert torch.equal(resample(weight, new_len), upstream_resample(weight, new_len))
    # AuroraPredictHead passes a transposed (non-contiguous) view
    assert torch.equal(resample(weight.T.contiguous().T, new_len), upstream_resample(weight.T.contiguous().T, new_len))


def test_resample_same_length_returns_input():
    weight = torch.randn(8, 48)
    assert resample(weight, 48) is weight


def test_resample_bf16_weights_computed_in_fp32():
    weight = torch.randn(32, 48, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with pytest.raises(RuntimeError):
        upstream_resample(weight, 24)  # the gap the patch closes
    out = resample(weight, 24)
    assert out.dtype == torch.bfloat16 and out.shape == (32, 24)
    assert torch.equal(out, upstream_resample(weight.float(), 24).to(torch.bfloat16))


def test_resample_rejects_bad_input():
    with pytest.raises(ValueError, match="2-D"):
        resample(torch.randn(2, 3, 4), 8)
    with pytest.raises(ValueError, match="positive"):
        resample(torch.randn(2, 3), 0)


def test_resample_caches_the_pinv(monkeypatch):
    calls = []
    original = patches._ORIGINAL_PINV
    monkeypatch.setattr(patches, "_ORIGINAL_PINV", lambda t: calls.append(t.shape) or original(t))
    patches._RESIZE_PINV_CACHE.clear()
    weight = torch.randn(8, 48)
    first = resample(weight, 24)
    second = resample(weight, 24)
    assert torch.equal(first, second)
    assert len(calls) == 1
    resample(weight, 30)
    assert len(calls) == 2
    patches._RESIZE_PINV_CACHE.clear()


def test_pinv_capability():
    assert patches.device_supports_pinv("cpu")
    assert not patches.device_supports_pinv("npu")  # guide §5.2: always the CPU on NPU


class _DeviceRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Records (op name, input devices, output devices, output shapes) of every aten call."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            out = func(*args, **kwargs)
        except RuntimeError as exc:
            # torch 2.5.1's FakeTensorMode runs FFTs through the real kernel (fake_impls'
            # stride workaround), which needs a real GPU: shape the output on the meta device.
            if "fft" not in str(func) or "NVIDIA driver" not in str(exc):
                raise
            meta = func(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in args], **kwargs)
            out = torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype, device=args[0].device)
        flat_in = [a for a in args if isinstance(a, torch.Tensor)]
        flat_out = [o for o in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(o, torch.Tensor)]
        self.calls.append((str(func), [a.device.type for a in flat_in], [o.device.type for o in flat_out],
                           [tuple(o.shape) for o in flat_out]))
        return out

    def cross_device_copies(self):
        return [c for c in self.calls if "copy" in c[0] and c[1] and c[2] and set(c[1]) != set(c[2])]


@needs_cuda_build
def test_resample_pinv_runs_on_cpu_where_device_lacks_it(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setitem(patches._PINV_SUPPORT, "cuda", False)
    patches._RESIZE_PINV_CACHE.clear()
    with FakeTensorMode(allow_non_fake_inputs=True):
        weight = torch.randn(8, 48, device="cuda")
        recorder = _DeviceRecorder()
        with recorder:
            out = resample(weight, 24)
            again = resample(weight, 24)
        assert out.device.type == "cuda" and again.device.type == "cuda"
    pinv_calls = [c for c in recorder.calls if "linalg" in c[0] or "svd" in c[0]]
    assert pinv_calls and all(c[1] == ["cpu"] for c in pinv_calls if c[1])
    moves = recorder.cross_device_copies()
    assert [c[1:3] for c in moves] == [(["cpu"], ["cuda"])]  # the cached pinv moves once, not per call
    patches._RESIZE_PINV_CACHE.clear()


# ---- causal_attention_mask and decay weights --------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 5, 11])
def test_causal_mask_bitwise_equal_to_upstream(n):
    assert torch.equal(causal_attention_mask(n), upstream_mask(n))
    assert torch.equal(causal_attention_mask(n, device="cpu", dtype=torch.float32), upstream_mask(n))
    bf16 = causal_attention_mask(n, dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16.float(), upstream_mask(n))


@pytest.mark.parametrize("n", [0, 1, 2, 13, 127, 149])
def test_decay_weights_exact(n):
    expected = 0.5 ** torch.arange(n)  # upstream's expression
    assert torch.equal(decay_weights(n), expected)
    if n <= 127:  # normal range of bf16 (2**-126); the docstring promises no more
        bf16 = decay_weights(n, dtype=torch.bfloat16)
        assert torch.equal(bf16, expected.to(torch.bfloat16))


# ---- FFT ---------------------------------------------------------------------------------------

def test_fft_fp32_passthrough_bitwise():
    x = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    assert torch.equal(rfft(x), upstream_rfft(x))
    assert torch.equal(rfft(x, 64, 0, "ortho"), upstream_rfft(x, 64, 0, "ortho"))
    assert torch.equal(rfft(x, n=40, dim=-1, norm="forward"), upstream_rfft(x, n=40, dim=-1, norm="forward"))
    spectrum = upstream_rfft(x)
    assert torch.equal(irfft(spectrum, dim=-1), upstream_irfft(spectrum, dim=-1))
    assert torch.equal(irfft(spectrum, n=50), upstream_irfft(spectrum, n=50))


def test_fft_bf16_upcast():
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    with pytest.raises((RuntimeError, NotImplementedError), match="BFloat16"):
        upstream_rfft(x)  # the gap (CPU and CANN)
    spectrum = rfft(x)
    assert spectrum.dtype == torch.complex64
    assert torch.equal(spectrum, upstream_rfft(x.float()))
    assert irfft(spectrum).dtype == torch.float32  # complex64 in → float32 out, as upstream
    real = irfft(x)  # a bf16 *real* input comes back in bf16
    assert real.dtype == torch.bfloat16 and torch.equal(real, upstream_irfft(x.float()).to(torch.bfloat16))


def test_fft_out_argument():
    x = torch.randn(4, 16)
    out = torch.empty(0, dtype=torch.complex64)
    result = rfft(x, out=out)
    assert result is out and torch.equal(out, upstream_rfft(x))


def test_fft_probe_is_cached(monkeypatch):
    calls = []

    def failing_rfft(t, *a, **k):
        calls.append(t.device.type)
        raise RuntimeError("rfft is not implemented on this device")

    monkeypatch.setattr(patches, "_ORIGINAL_RFFT", failing_rfft)
    monkeypatch.setattr(patches, "_FFT_SUPPORT", {})
    assert patches.device_supports_fft("cpu")
    assert calls == []
    assert not patches.device_supports_fft("meta")
    assert not patches.device_supports_fft(torch.device("meta"))
    assert calls == ["meta"]


@needs_cuda_build
@pytest.mark.parametrize("fallback", [True, False])
def test_fft_cpu_fallback_routes_through_cpu(fallback):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with patched("cuda", fft_fallback=fallback) as patch_set:
        assert ("fft_cpu_fallback" in patch_set.applied) is fallback
        with FakeTensorMode(allow_non_fake_inputs=True):
            x = torch.randn(2, 64, device="cuda")
            recorder = _DeviceRecorder()
            with recorder:
                spectrum = torch.fft.rfft(x, dim=-1)
                back = torch.fft.irfft(spectrum, dim=-1)
            assert spectrum.device.type == "cuda" and back.device.type == "cuda"
    fft_devices = [c[1] for c in recorder.calls if "fft" in c[0]]
    assert len(fft_devices) == 2
    assert all(d == (["cpu"] if fallback else ["cuda"]) for d in fft_devices)


def test_mse_loss_upcast_is_exact_and_only_for_bf16_cpu():
    a, b = torch.randn(4, 5), torch.randn(4, 5)
    assert torch.equal(patches.mse_loss(a, b, reduction="none"), torch.nn.functional.mse_loss(a, b, reduction="none"))
    ab, bb = a.bfloat16(), b.bfloat16()
    expected = torch.nn.functional.mse_loss(ab.float(), bb.float(), reduction="none").bfloat16()
    got = patches.mse_loss(ab, bb, reduction="none")
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)
    try:  # the probe tells the truth about this torch's kernel
        patches._ORIGINAL_MSE(ab, bb)
        raised = False
    except RuntimeError:
        raised = True
    assert patches.cpu_lacks_bf16_mse() is raised


# ---- apply / revert ----------------------------------------------------------------------------

def test_apply_and_revert_restore_exact_upstream_objects():
    assert _state_is_upstream()
    patch_set = apply_all_patches()
    try:
        for (owner, attr), original in UPSTREAM.items():
            current = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr)
            assert current is not original, f"{attr} of {owner} was not patched"
        assert modeling.resample is resample and flow_mod.resample is resample and util.resample is resample
        assert retriever_mod.causal_attention_mask is causal_attention_mask
        assert patch_set.applied == (["resample", "causal_attention_mask", "decay_weights", "sinusoidal_dtype",
                                      "flow_input_dtype", "text_features_dtype", "fft_bf16_upcast",
                                      "freq_masking_dtype"] + (["mse_bf16_upcast"] if patches.cpu_lacks_bf16_mse() else [])
                                     + ["real_image_device"])
        assert set(patch_set.describe()) == set(patch_set.applied)
    finally:
        patch_set.revert()
    assert _state_is_upstream()
    assert not patch_set.active and patches.active_patch_set() is None
    patch_set.revert()  # idempotent
    assert _state_is_upstream()


def test_apply_is_idempotent():
    first = apply_all_patches()
    try:
        bindings = {key: (key[0].__dict__.get(key[1]) if isinstance(key[0], type) else getattr(*key))
                    for key in UPSTREAM}
        second = apply_all_patches()
        assert second is first
        assert len(second.replaced) == len(first.replaced) == len(set(first.replaced))
        for key, value in bindings.items():
            now = key[0].__dict__.get(key[1]) if isinstance(key[0], type) else getattr(*key)
            assert now is value
    finally:
        first.revert()
    assert _state_is_upstream()


def test_conflicting_settings_are_refused():
    with patched(None, fft_fallback=False):
        with pytest.raises(PatchError, match="already active"):
            apply_all_patches(None, fft_fallback=True)
    with patched(None, fft_fallback=True) as patch_set:
        assert "fft_cpu_fallback" in patch_set.applied
    assert _state_is_upstream()


def test_invalid_arguments():
    with pytest.raises(ValueError, match="invalid device"):
        apply_all_patches("no-such-device:x")
    with pytest.raises(ValueError, match="fft_fallback"):
        apply_all_patches(fft_fallback="yes")
    assert _state_is_upstream()


def test_patched_context_reverts_on_exit_and_on_error():
    with patched() as patch_set:
        assert patches.active_patch_set() is patch_set and not _state_is_upstream()
    assert _state_is_upstream()
    with pytest.raises(ZeroDivisionError):
        with patched():
            1 / 0
    assert _state_is_upstream()


def test_nested_patched_keeps_outer_set():
    with patched() as outer:
        with patched() as inner:
            assert inner is outer
        assert outer.active and not _state_is_upstream()
    assert _state_is_upstream()


def test_each_patch_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="pytest_npu_parity.aurora.patches"):
        with patched() as patch_set:
            pass
    lines = [r.getMessage() for r in caplog.records if r.name == "pytest_npu_parity.aurora.patches"]
    for name in patch_set.applied:
        assert any(line.startswith(f"[NPU-PATCH] applied {name}:") for line in lines), name
    assert any(line.startswith("[NPU-PATCH] reverted") for line in lines)


def test_failed_apply_leaves_upstream(monkeypatch):
    monkeypatch.setattr(patches, "_TIMESTEP_EDIT", ("this text is not in upstream", "x", 1))
    with pytest.raises(PatchError, match="TimestepEmbedder.forward.*this text is not in upstream"):
        apply_all_patches()
    assert patches.active_patch_set() is None
    assert _state_is_upstream()


def test_edit_function_checks():
    captured = 1

    def closure():
        return captured

    with pytest.raises(PatchError, match="closure"):
        patches.edit_function(closure, [])
    edited = patches.edit_function(util.causal_attention_mask, [("diagonal=1", "diagonal=2", 1)])
    assert edited is not util.causal_attention_mask
    assert edited.__code__.co_filename == util.causal_attention_mask.__code__.co_filename
    assert edited.__code__.co_firstlineno == util.causal_attention_mask.__code__.co_firstlineno
    assert torch.equal(edited(4)[0, 0], torch.triu(torch.full((4, 4), float("-inf")), diagonal=2))
    with pytest.raises(PatchError, match="expected 2 occurrence"):
        patches.edit_function(util.causal_attention_mask, [("diagonal=1", "x", 2)])


# ---- call sites: device of the mask and decay weights -------------------------------------------

def test_call_sites_pass_the_input_device_and_parameter_dtype(tiny, batch):
    seen = []

    def spy_mask(n, device=None, dtype=None):
        seen.append(("mask", n, device, dtype))
        return causal_attention_mask(n, device=device, dtype=dtype)

    def spy_decay(n, device=None, dtype=None):
        seen.append(("decay", n, device, dtype))
        return decay_weights(n, device=device, dtype=dtype)

    with patched():
        saved = (modeling.causal_attention_mask, retriever_mod.causal_attention_mask,
                 modeling._npu_parity_decay_weights)
        modeling.causal_attention_mask = retriever_mod.causal_attention_mask = spy_mask
        modeling._npu_parity_decay_weights = spy_decay
        try:
            with torch.no_grad():
                tiny(**batch.forward_kwargs(96))
        finally:
            (modeling.causal_attention_mask, retriever_mod.causal_attention_mask,
             modeling._npu_parity_decay_weights) = saved
    masks = [s for s in seen if s[0] == "mask"]
    # 2 decoder layers + retriever encoder (11 context tokens) + retriever decoder (2 output tokens)
    assert sorted(s[1] for s in masks) == [2, 2, 2, 11]
    assert all(s[2] == torch.device("cpu") and s[3] == torch.float32 for s in seen)
    assert [s[:2] for s in seen if s[0] == "decay"] == [("decay", 2)]


def test_decoder_layer_mask_is_built_on_the_device():
    # The meta device stands in for an accelerator: shapes and devices without data, on any torch
    # (torch 2.5.1's FakeTensorMode cannot place a module on a fake "cuda" without a GPU driver).
    config = AuroraConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4)
    torch.manual_seed(0)
    layers = [modeling.AuroraDecoderLayer(config, 0).eval() for _ in range(2)]
    results = {}
    for use_patch, layer in zip((False, True), layers):
        layer = layer.to("meta")
        hidden, cross = torch.randn(2, 3, 32, device="meta"), torch.randn(2, 5, 32, device="meta")
        recorder = _DeviceRecorder()
        context = patched("meta", fft_fallback=False) if use_patch else _null()
        with context, recorder:
            layer(hidden, cross)
        results[use_patch] = recorder
    mask_shape = (1, 1, 3, 3)
    # upstream: built on the CPU, then copied to the device
    assert any(c[3] == [mask_shape] for c in results[False].cross_device_copies())
    assert not any(c[3] == [mask_shape] for c in results[True].cross_device_copies())
    assert not any(c[2] == ["cpu"] and c[3] == [mask_shape] for c in results[True].calls)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# ---- whole model: equal to upstream in fp32 and autocast, runnable in bf16 ------------------------

def _eval(model, batch, **extra):
    torch.manual_seed(0)
    with torch.no_grad():
        return model(**batch.forward_kwargs(96), **extra).logits


def _train_step(model, batch):
    model = copy.deepcopy(model).train()
    torch.manual_seed(0)
    random.seed(0)
    loss = model(**batch.forward_kwargs(96, train=True)).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def test_full_forward_bitwise_equal_to_upstream_fp32(tiny, batch):
    reference = _eval(tiny, batch)
    ref_loss, ref_grads = _train_step(tiny, batch)
    with patched():
        patched_out = _eval(tiny, batch)
        loss, grads = _train_step(tiny, batch)
    assert torch.equal(patched_out, reference)
    assert torch.equal(loss, ref_loss)
    assert ref_grads.keys() == grads.keys() and len(grads) > 50
    for name in ref_grads:
        assert torch.equal(grads[name], ref_grads[name]), name


def test_autocast_forward_bitwise_equal_to_upstream(tiny, batch):
    from pytest_npu_parity.recipes import RECIPES

    with RECIPES["bf16"].context(torch.device("cpu")):  # autocast, with the torch 2.5.1 fast-path shim
        reference = _eval(tiny, batch)
        with patched():
            patched_out = _eval(tiny, batch)
    assert torch.equal(patched_out, reference)


def test_bf16_weights_run_only_with_the_patch_set(tiny, batch):
    model = copy.deepcopy(tiny).to(torch.bfloat16)
    bf16_batch = batch.to(dtype=torch.bfloat16)
    with pytest.raises((RuntimeError, NotImplementedError)):
        _eval(model, bf16_batch)
    with patched():
        out = _eval(model, bf16_batch)
        loss, grads = _train_step(model, bf16_batch)
    assert out.shape == (2, 1, 96) and torch.isfinite(out).all()
    assert loss.dtype == torch.bfloat16 and torch.isfinite(loss)
    assert all(g.dtype == torch.bfloat16 for g in grads.values())
    # close to the fp32 forecast (bf16 weights: a few per cent of the ≈ 10 ppm spread)
    reference = _eval(tiny, batch)
    assert (out.float() - reference).abs().max() < 0.05 * (reference.max() - reference.min())


# ---- real images: the ViT image processor's host tensor ----------------------------------------

def test_real_image_path_bitwise_equal_to_upstream_and_pseudo_path_untouched(tiny, batch):
    from pytest_npu_parity.aurora.inputs import real_images, revin_normalize

    encoder = tiny.model.VisionEncoder
    images = real_images(2, crop=200)
    series = revin_normalize(batch.context)
    with torch.no_grad():
        reference = encoder(images, type="real"), encoder(series, type="pseudo")
        with patched():
            assert "real_image_device" in patches.active_patch_set().applied
            out = encoder(images, type="real"), encoder(series, type="pseudo")
    assert torch.equal(out[0], reference[0]) and torch.equal(out[1], reference[1])
    assert out[0].shape == (2, tiny.config.num_distill, tiny.config.hidden_size)


def test_real_image_pixels_reach_the_vit_on_its_device(tiny):
    # The meta device stands in for an accelerator (as for the decoder mask above): upstream hands
    # the processor's CPU pixel_values to a ViT on the device; the patched forward moves them.
    from pytest_npu_parity.aurora.inputs import real_images

    encoder = copy.deepcopy(tiny.model.VisionEncoder).to("meta")
    images = real_images(2, crop=100)
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="device"):
            encoder(images, type="real")
        with patched("meta", fft_fallback=False):
            out = encoder(images, type="real")
    assert out.device.type == "meta" and out.shape == (2, tiny.config.num_distill, tiny.config.hidden_size)


def _binding(owner, attr):
    return owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)


def test_suspended_turns_one_patch_off_and_puts_it_back():
    with patched("cpu") as patch_set:
        in_force = {key: _binding(*key) for key in UPSTREAM}
        with patch_set.suspended("resample", "causal_attention_mask"):
            for (owner, attr), upstream in UPSTREAM.items():
                now = _binding(owner, attr)
                if attr == "resample":
                    assert now is upstream  # every rebound name is upstream's again
                elif (owner, attr) in ((util, "causal_attention_mask"), (modeling, "causal_attention_mask"),
                                       (retriever_mod, "causal_attention_mask"),
                                       (modeling.AuroraDecoderLayer, "forward"), (retriever_mod.Retriever, "forward")):
                    assert now is upstream, (owner, attr)
                else:  # the rest of the set stays in force
                    assert now is in_force[(owner, attr)], (owner, attr)
            assert torch.fft.rfft is rfft
        assert all(_binding(*key) is in_force[key] for key in UPSTREAM)  # back on exit
        with pytest.raises(RuntimeError), patch_set.suspended("fft_bf16_upcast"):
            assert torch.fft.rfft is not rfft
            raise RuntimeError("the body raised")
        assert torch.fft.rfft is rfft  # back also when the body raises
        with pytest.raises(PatchError, match=r"no_such_patch: not an applied patch \(applied: resample, "):
            with patch_set.suspended("no_such_patch"):
                pass
    with pytest.raises(PatchError, match="no longer active"), patch_set.suspended("resample"):
        pass
