"""First-divergence localization on the full seeded Aurora: a fault in decoder layer 4 is named.

Four port bugs are injected into ``model.dec_layers.4`` on the target side only (inside the patch
factory, on top of the NPU patch set), and the full-model eval forward (``forward_eval``) must fail
with a message whose first divergence is that layer (or a submodule of it), with a local error
larger than the inherited one:

* a scaled weight: the layer's largest trainable matrix (``checks.sensitive_weight``) × (1 + 1e-4);
* a dropped mask: inside layer 4 only, ``causal_attention_mask`` builds an all-zero mask (the layer's
  own code, outside its submodules, hands the wrong mask to its self-attention);
* a wrong attention scale: layer 4's self-attention divides its scores by head_dim^(1/4) instead of
  sqrt(head_dim);
* a wrong norm eps: layer 4's second BatchNorm with eps 1e-3 instead of upstream's 1e-5 (named down to
  that norm);
* a softmax kernel computing in half precision inside layer 4's self-attention only (named down to the
  op: ``aten._softmax`` at upstream's softmax line, a local error far beyond the float32 budget).

The reference is a live CPU run of the unpatched upstream model. The faults share one
``Localizer`` (as a session does), and the scaled-weight case also checks decoder layer 4 on the
activations the model hands it (``decoder_layer_4``, as the suite does): the whole model's descent
answers it without running anything.
"""
from __future__ import annotations

import contextlib
import math
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from pytest_npu_parity.aurora import checks, patches
from pytest_npu_parity.compare import ParityError
from pytest_npu_parity.localize import Localizer
from pytest_npu_parity.runner import ParityCase, ParitySession

LAYER = "model.dec_layers.4"


@pytest.fixture(scope="module")
def ctx(aurora_ctx) -> checks.AuroraContext:
    return aurora_ctx  # tests/conftest.py: built once per process


@pytest.fixture(scope="module")
def localizer() -> Localizer:
    return Localizer(budget_s=None)


@pytest.fixture(scope="module")
def session(localizer) -> ParitySession:
    return ParitySession(torch.device("cpu"), reference="cpu", failure_hooks=[localizer])


def _scaled_weight(layer: torch.nn.Module):
    return checks.scaled_parameter(layer, checks.sensitive_weight(layer), 1 + 1e-4)


@contextlib.contextmanager
def _dropped_mask(layer: torch.nn.Module):
    import aurora.modeling_aurora as modeling

    saved = []

    def no_mask(seq_length, *args, **kwargs):
        device = kwargs.get("device") or (args[0] if args else None)
        return torch.zeros(1, 1, seq_length, seq_length, device=device)

    def swap(module, args):
        saved.append(modeling.causal_attention_mask)  # the patch set's version, on the target
        modeling.causal_attention_mask = no_mask

    def restore(module, args, output):
        modeling.causal_attention_mask = saved.pop()

    handles = [layer.register_forward_pre_hook(swap), layer.register_forward_hook(restore)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _wrong_scale(layer: torch.nn.Module):
    attention = layer.self_attn
    upstream = type(attention)._scaled_dot_product_attention

    def scores_scaled_by_fourth_root(self, Q, K, V, bias=None, attn_mask=None):
        # upstream divides Q·Kᵀ by sqrt(d); this divides by d ** 0.25
        return upstream(self, Q * Q.size(-1) ** 0.25, K, V, bias=bias, attn_mask=attn_mask)

    attention._scaled_dot_product_attention = types.MethodType(scores_scaled_by_fourth_root, attention)
    try:
        yield
    finally:
        del attention._scaled_dot_product_attention


@contextlib.contextmanager
def _wrong_norm_eps(layer: torch.nn.Module):
    # a port's BatchNorm built with another eps (1e-3 for upstream's 1e-5): the layer's second norm
    norm = layer.norm2[1]
    eps, norm.eps = norm.eps, 1e-3
    try:
        yield
    finally:
        norm.eps = eps


class _HalfSoftmax(TorchDispatchMode):
    """``aten._softmax`` computed in float16 (and cast back) while ``on``; exact otherwise."""

    on = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._softmax.default and self.on:
            x, dim, _ = args
            with _disable_current_modes():
                return func(x.half(), dim, False).to(x.dtype)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _half_softmax(layer: torch.nn.Module):
    # the kernel is wrong only inside layer 4's self-attention: hooks switch it (no frame is added to the op's stack)
    kernel = _HalfSoftmax()

    def on(module, args):
        kernel.on = True

    def off(module, args, output):
        kernel.on = False

    handles = [layer.self_attn.register_forward_pre_hook(on), layer.self_attn.register_forward_hook(off)]
    try:
        with kernel:
            yield
    finally:
        for handle in handles:
            handle.remove()


FAULTS = {"scaled_weight": _scaled_weight, "dropped_mask": _dropped_mask, "wrong_scale": _wrong_scale,
          "wrong_norm_eps": _wrong_norm_eps, "half_softmax": _half_softmax}


@pytest.mark.parametrize("fault", FAULTS)
def test_full_forward_failure_names_the_faulty_decoder_layer(ctx, session, localizer, fault):
    layer = ctx.submodule(LAYER)

    @contextlib.contextmanager
    def target_patches(device):
        with patches.patched(device), FAULTS[fault](layer):
            yield

    check = checks.BY_NAME["forward_eval"]
    fn, args, kwargs = check.build(ctx)
    case = ParityCase(session, f"tests/aurora/test_localize_aurora.py::{fault}", "fp32", patches=target_patches)
    with pytest.raises(ParityError) as info:
        case.check(check.name, fn, *args, submodule=check.submodule or None, **kwargs)
    message = str(info.value)
    rows = case.records[-1].extra["localization"]
    first = [row for row in rows if row.get("first_divergence")]
    assert len(first) == 1, message
    first = first[0]
    assert first["submodule"] == LAYER or first["submodule"].startswith(LAYER + "."), message
    assert first["local_err_ratio"] > 1, message
    assert first["local_err_ratio"] > first["inherited_err_ratio"], message
    assert first["local_rel_l2"] > first["inherited_rel_l2"], message
    assert f"First divergence: {first['submodule']}" in message
    # The layers before it agree; the one after only inherits the error.
    by_path = {row["submodule"]: row for row in rows}
    assert by_path["model.dec_layers.3"]["verdict"] == "ok"
    assert by_path["model.dec_layers.5"]["verdict"] == "inherited"
    if fault == "dropped_mask":  # the mask is built in the layer's own forward, not in a child
        assert first["submodule"] == LAYER and "in its own code outside its submodules" in message
    if fault == "wrong_norm_eps":  # the descent goes down to the norm itself
        assert first["submodule"] in (f"{LAYER}.norm2", f"{LAYER}.norm2.1"), message
    if fault == "half_softmax":  # down to the op, at upstream's softmax line
        assert first["submodule"] == f"{LAYER}.self_attn", message
        op = next(row for row in case.records[-1].localized.localization_ops if row["first_op"])
        assert op["op"] == "aten._softmax" and op["verdict"] == "local", message
        assert "modeling_aurora.py:" in op["source"] and "F.softmax(attn_scores, dim=-1)" in op["source"], message
        assert op["local"] > 10 * op["budget"], message
    assert math.isfinite(first["local_max_abs"])
    # What makes it pass: the first divergence replaced by its float64 CPU reference (computed outside the
    # patch set, so the dropped mask does not reach it) removes the error, as turning the patch set off does.
    counterfactual = [row for row in case.records[-1].whatfix.counterfactual if row["kind"] == "counterfactual"]
    named = [row for row in counterfactual if row["why"].startswith("first divergence")]
    assert len(named) == 1 and first["submodule"].endswith(named[0]["submodule"]), message
    assert named[0]["verdict"] == "root cause" and named[0]["share"] > 0.9, message
    if fault != "scaled_weight":
        return
    # The decoder-layer check on the activations the model handed layer 4: answered by the descent
    # above (same module, weights, reference inputs, random state, recipe and patch set), nothing run.
    calls = []
    handle = layer.register_forward_pre_hook(lambda *_: calls.append(1))
    check = checks.BY_NAME["decoder_layer_4"]
    fn, args, kwargs = check.build(ctx)
    case = ParityCase(session, "tests/aurora/test_localize_aurora.py::layer", "fp32", patches=target_patches)
    try:
        with pytest.raises(ParityError) as info:
            case.check(check.name, fn, *args, submodule=check.submodule, **kwargs)
    finally:
        handle.remove()
    assert len(calls) == 2  # the check's own reference and target runs
    extra = case.records[-1].extra
    assert extra["localization_reused"].startswith("'forward_eval'"), str(info.value)
    shared = [row for row in extra["localization"] if row.get("first_divergence")]
    assert [row["submodule"] for row in shared] == [first["submodule"]]
    assert shared[0]["local_err_ratio"] == first["local_err_ratio"]
