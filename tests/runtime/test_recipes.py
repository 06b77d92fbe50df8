"""Tests of pytest_npu_parity.recipes: strict fp32 flags (set inside, restored after), the bf16 and
fp16 autocast recipes, the fp16 recipe's GradScaler per device, recipe parsing."""
from __future__ import annotations

import copy
import sys
import types

import pytest
import torch

from pytest_npu_parity import recipes
from pytest_npu_parity.recipes import (RECIPES, Recipe, RecipeError, make_grad_scaler, parse_recipes, precision_flags,
                                       strict_fp32_flags)

NEW_API = hasattr(torch.backends, "fp32_precision")  # torch >= 2.9


@pytest.fixture
def loose_flags():
    """Put every precision flag in a non-strict state for the test and restore torch's after."""
    saved = precision_flags()
    saved_knobs = _knobs()
    torch.set_float32_matmul_precision("high")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    loose = precision_flags()
    yield loose
    torch.set_float32_matmul_precision(saved["float32_matmul_precision"] or "highest")
    torch.backends.cuda.matmul.allow_tf32 = bool(saved["cuda.matmul.allow_tf32"])
    torch.backends.cudnn.allow_tf32 = bool(saved["cudnn.allow_tf32"])
    for holder, value in saved_knobs:
        holder.fp32_precision = value


def _knobs():
    if not NEW_API:
        return []
    b = torch.backends
    holders = [b, b.cuda.matmul, b.cudnn, b.cudnn.conv, b.cudnn.rnn, b.mkldnn, b.mkldnn.matmul, b.mkldnn.conv, b.mkldnn.rnn]
    return [(h, h.fp32_precision) for h in holders]


def _assert_strict(flags):
    assert flags["float32_matmul_precision"] == "highest"
    assert flags["cuda.matmul.allow_tf32"] is False
    assert flags["cudnn.allow_tf32"] is False
    knobs = {k: v for k, v in flags.items() if k.endswith("fp32_precision")}
    if NEW_API:
        assert len(knobs) == 9
    assert set(knobs.values()) <= {"ieee"}


def test_strict_inside_and_restored_after(loose_flags):
    assert loose_flags["float32_matmul_precision"] == "high" and loose_flags["cuda.matmul.allow_tf32"] is True
    with strict_fp32_flags():
        _assert_strict(precision_flags())
    assert precision_flags() == loose_flags


def test_restored_after_an_exception(loose_flags):
    with pytest.raises(KeyError):
        with strict_fp32_flags():
            _assert_strict(precision_flags())
            raise KeyError("boom")
    assert precision_flags() == loose_flags


def test_nested_blocks_restore_in_order(loose_flags):
    with strict_fp32_flags():
        inner_before = precision_flags()
        with strict_fp32_flags():
            _assert_strict(precision_flags())
        assert precision_flags() == inner_before
    assert precision_flags() == loose_flags


@pytest.mark.skipif(not NEW_API, reason="torch < 2.9 has no fp32_precision knobs")
def test_new_api_knobs_are_strict_and_restored(loose_flags):
    # oneDNN fp32 convs in TF32 and matmuls in bf16 on the CPU: the legacy getter cannot express
    # this mix and raises; the strict block must neither crash nor leave it behind.
    torch.backends.mkldnn.conv.fp32_precision = "tf32"
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    with pytest.raises(RuntimeError):
        torch.get_float32_matmul_precision()
    before = precision_flags()
    assert before["float32_matmul_precision"] is None  # reported as inexpressible, not a crash
    with strict_fp32_flags():
        _assert_strict(precision_flags())
    after = precision_flags()
    assert after == before
    assert torch.backends.mkldnn.conv.fp32_precision == "tf32"
    assert torch.backends.mkldnn.matmul.fp32_precision == "bf16"


def test_npu_hf32_flags_are_switched_off_and_restored(monkeypatch):
    # torch_npu's defaults: matmul HF32 off, conv HF32 on.
    fake_npu = types.SimpleNamespace(matmul=types.SimpleNamespace(allow_hf32=False),
                                     conv=types.SimpleNamespace(allow_hf32=True))
    monkeypatch.setattr(torch, "npu", fake_npu, raising=False)
    assert precision_flags()["npu.conv.allow_hf32"] is True
    with strict_fp32_flags():
        assert (fake_npu.matmul.allow_hf32, fake_npu.conv.allow_hf32) == (False, False)
        assert precision_flags()["npu.conv.allow_hf32"] is False
    assert (fake_npu.matmul.allow_hf32, fake_npu.conv.allow_hf32) == (False, True)
    with pytest.raises(ValueError):
        with strict_fp32_flags():
            raise ValueError
    assert fake_npu.conv.allow_hf32 is True


def test_precision_flags_without_npu_has_no_npu_keys():
    assert not any(k.startswith("npu.") for k in precision_flags())


# --------------------------------------------------------------------------------------------
# recipes


def _autocast_enabled() -> bool:
    try:
        return torch.is_autocast_enabled("cpu")
    except TypeError:  # torch < 2.4 form
        return torch.is_autocast_cpu_enabled()


def test_bf16_recipe_runs_a_linear_in_bf16_under_cpu_autocast():
    g = torch.Generator().manual_seed(1)
    linear = torch.nn.Linear(16, 4)
    x = torch.randn(3, 16, generator=g)
    with RECIPES["bf16"].context(torch.device("cpu")):
        assert _autocast_enabled()
        _assert_strict(precision_flags())
        y = linear(x)
    assert not _autocast_enabled()
    assert y.dtype == torch.bfloat16
    assert linear.weight.dtype == torch.float32  # weights stay fp32: autocast casts per op
    manual = torch.nn.functional.linear(x.bfloat16(), linear.weight.bfloat16(), linear.bias.bfloat16())
    assert torch.equal(y, manual)


def test_fp32_recipe_runs_in_fp32_with_strict_flags():
    linear = torch.nn.Linear(16, 4)
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(2))
    with RECIPES["fp32"].context(torch.device("cpu")):
        assert not _autocast_enabled()
        _assert_strict(precision_flags())
        y = linear(x)
    assert y.dtype == torch.float32


def test_recipe_table():
    assert list(RECIPES) == ["fp32", "bf16", "bf16-weights", "fp16"]
    assert RECIPES["fp32"] == Recipe("fp32")
    assert (RECIPES["bf16"].autocast_dtype, RECIPES["bf16"].weights_dtype) == (torch.bfloat16, None)
    assert (RECIPES["bf16-weights"].autocast_dtype, RECIPES["bf16-weights"].weights_dtype) == (None, torch.bfloat16)
    assert (RECIPES["fp16"].autocast_dtype, RECIPES["fp16"].weights_dtype) == (torch.float16, None)
    assert [name for name, r in RECIPES.items() if r.loss_scaling] == ["fp16"]
    assert recipes.DEFAULT_RECIPES == "fp32,bf16"  # fp16 is opt-in


def test_fp16_recipe_runs_a_linear_in_fp16_under_cpu_autocast():
    g = torch.Generator().manual_seed(3)
    linear = torch.nn.Linear(16, 4)
    x = torch.randn(3, 16, generator=g)
    with RECIPES["fp16"].context(torch.device("cpu")):
        assert _autocast_enabled()
        _assert_strict(precision_flags())
        y = linear(x)
    assert not _autocast_enabled()
    assert y.dtype == torch.float16 and linear.weight.dtype == torch.float32
    manual = torch.nn.functional.linear(x.half(), linear.weight.half(), linear.bias.half())
    assert torch.equal(y, manual)


def test_fp16_recipe_runs_the_transformer_encoder_fast_path():
    # torch 2.5.1: the fast path raises "got Half and Float" under CPU fp16 autocast; the shim casts
    # its arguments, which gives bitwise the fast path of an fp16 copy of the layer.
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 4, 32, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad(), RECIPES["fp16"].context(torch.device("cpu")):
        y = layer(x)
    assert y.dtype == torch.float16 and torch.isfinite(y).all()
    if recipes.cpu_autocast_breaks_encoder_fast_path(torch.float16):
        with torch.no_grad():
            assert torch.equal(y, copy.deepcopy(layer).half()(x.half()))
    assert torch._transformer_encoder_layer_fwd is recipes._ENCODER_FAST_PATH[0]  # restored


def _scaled_grad(scaler, weight):
    opt = torch.optim.SGD([weight], lr=0.0)
    loss = (weight * torch.tensor([1.0, -2.0])).sum()
    scaler.scale(loss).backward()
    scaled = weight.grad.clone()
    scaler.unscale_(opt)
    return scaled, weight.grad.clone()


def test_cpu_grad_scaler_is_torch_amp_scaling_by_two_to_the_16():
    scaler = make_grad_scaler(torch.device("cpu"))
    assert type(scaler) is torch.amp.GradScaler and scaler.get_scale() == 2.0 ** 16
    scaled, unscaled = _scaled_grad(scaler, torch.zeros(2, requires_grad=True))
    assert torch.equal(scaled, torch.tensor([65536.0, -131072.0]))
    assert torch.equal(unscaled, torch.tensor([1.0, -2.0]))


def test_npu_grad_scaler_is_torch_npus_without_a_device_argument(monkeypatch):
    made = []

    class FakeNpuScaler:  # torch_npu 2.5.1: GradScaler(init_scale=2.**16, ..., dynamic=True, enabled=True)
        def __init__(self, *args, **kwargs):
            made.append((args, kwargs))

    amp = types.ModuleType("torch_npu.npu.amp")
    amp.GradScaler = FakeNpuScaler
    monkeypatch.setitem(sys.modules, "torch_npu.npu.amp", amp)
    assert isinstance(make_grad_scaler("npu:1"), FakeNpuScaler)
    assert made == [((), {})]


def test_grad_scaler_fallbacks_when_torch_has_no_torch_amp_scaler(monkeypatch):
    legacy = []
    monkeypatch.delattr(torch.amp, "GradScaler")
    monkeypatch.setattr(torch.cuda.amp, "GradScaler", lambda: legacy.append("cuda") or "cuda-scaler", raising=False)
    assert make_grad_scaler("cuda:0") == "cuda-scaler" and legacy == ["cuda"]
    monkeypatch.delattr(torch.cpu.amp, "GradScaler", raising=False)
    with pytest.raises(RecipeError, match=r"the fp16 recipe needs a GradScaler for cpu, and torch .* has neither "
                                          r"torch.amp.GradScaler nor torch.cpu.amp.GradScaler; run --parity-dtypes bf16"):
        make_grad_scaler("cpu")


def test_bf16_weights_recipe_does_not_autocast():
    with RECIPES["bf16-weights"].context(torch.device("cpu")):
        assert not _autocast_enabled()
        _assert_strict(precision_flags())


@pytest.mark.parametrize("text,names", [
    ("fp32", ["fp32"]),
    ("fp32,bf16", ["fp32", "bf16"]),
    (" bf16 , fp32 ,", ["bf16", "fp32"]),
    ("bf16,fp32,bf16", ["bf16", "fp32"]),  # duplicates dropped, first order kept
    ("bf16-weights", ["bf16-weights"]),
    ("fp32,fp16", ["fp32", "fp16"]),
])
def test_parse_recipes(text, names):
    assert [r.name for r in parse_recipes(text)] == names


@pytest.mark.parametrize("text,message", [
    ("", r"--parity-dtypes is empty; give e.g. 'fp32,bf16'"),
    (" , ", r"--parity-dtypes is empty"),
    ("fp32,fp8,int4", r"--parity-dtypes: unknown recipe\(s\) fp8, int4; known: fp32, bf16, bf16-weights, fp16"),
    ("FP32", r"unknown recipe\(s\) FP32"),
])
def test_parse_recipes_errors(text, message):
    with pytest.raises(ValueError, match=message):
        parse_recipes(text)


def test_recipe_unsupported_error_is_one_sentence_naming_op_module_recipe_and_the_fix():
    from pytest_npu_parity.recipes import RecipeUnsupportedError

    backend = RuntimeError("expected scalar type Float but found BFloat16\nmore backend detail")
    error = RecipeUnsupportedError("bf16", torch.device("cpu"), backend, op="aten::index_add_",
                                   module="head (Linear)", where="model.py:12")
    text = str(error)
    assert text.startswith("aten::index_add_ in head (Linear) (at model.py:12) cannot run on cpu under recipe bf16")
    assert "(RuntimeError: expected scalar type Float but found BFloat16)" in text and "more backend" not in text
    assert '@pytest.mark.parity(recipes=["fp32"])' in text and "\n" not in text
    assert isinstance(error, RuntimeError) and (error.recipe, error.op) == ("bf16", "aten::index_add_")
    long = RecipeUnsupportedError("bf16", "cpu", RuntimeError("x" * 500))
    assert str(long).startswith("an op cannot run on cpu") and "x" * 157 + "..." in str(long)
