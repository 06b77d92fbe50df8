"""Tests of pytest_npu_parity.rng: identical draws inside ``same_randomness``, the replacements'
argument forms, the reference formula of SDPA with dropout, and restoring everything after."""
from __future__ import annotations

import math
import random
import types

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from pytest_npu_parity import rng
from pytest_npu_parity.rng import _ORIGINALS, same_randomness, seed_everything

REPLACED = [(torch, "rand"), (torch, "randn"), (torch, "rand_like"), (torch, "randn_like"), (torch, "randint"),
            (F, "dropout"), (F, "scaled_dot_product_attention")]


def _run_twice(fn, seed=0):
    with same_randomness(seed):
        first = fn()
    with same_randomness(seed):
        second = fn()
    return first, second


def _assert_bitwise_equal(x, y):
    if isinstance(x, (tuple, list)):
        assert len(x) == len(y)
        for xi, yi in zip(x, y):
            _assert_bitwise_equal(xi, yi)
        return
    assert x.dtype == y.dtype and x.shape == y.shape
    assert torch.equal(x, y)


def _differs(x, y) -> bool:
    if isinstance(x, (tuple, list)):
        return any(_differs(xi, yi) for xi, yi in zip(x, y))
    return not torch.equal(x, y)


# --------------------------------------------------------------------------------------------
# identical draws; different seeds differ


def _encoder_layer():
    torch.manual_seed(0)  # weights outside the block: both runs use the same module
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=4, dim_feedforward=32, dropout=0.25, batch_first=True)
    return layer.train()


_LAYER = _encoder_layer()
_X = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(1))

SOURCES_OF_RANDOMNESS = {
    "nn.Dropout": lambda: nn.Dropout(0.3).train()(_X),
    "F.dropout": lambda: F.dropout(_X, p=0.4),
    "F.dropout-inplace": lambda: F.dropout(_X.clone(), p=0.4, training=True, inplace=True),
    "TransformerEncoderLayer-train": lambda: _LAYER(_X),
    "MultiheadAttention-need-weights": lambda: nn.MultiheadAttention(16, 4, dropout=0.5, batch_first=True)(_X, _X, _X),
    "randn_like": lambda: torch.randn_like(_X),
    "rand_like": lambda: torch.rand_like(_X, dtype=torch.float64),
    "rand-device": lambda: torch.rand(7, device=_X.device),
    "randn-then-to": lambda: torch.randn(4, 3).to(_X.device),
    "randint-high-size": lambda: torch.randint(10, (6,)),
    "randint-low-high-size": lambda: torch.randint(-5, 5, (2, 3)),
    "randint-size-keyword": lambda: torch.randint(0, 100, size=(4,)),
    "sequence": lambda: (torch.rand(3), torch.randn(2, 2), F.dropout(torch.ones(8), 0.5), torch.randint(3, (5,))),
}


@pytest.mark.parametrize("name", list(SOURCES_OF_RANDOMNESS))
def test_two_runs_are_bitwise_identical_and_seeds_matter(name):
    fn = SOURCES_OF_RANDOMNESS[name]
    first, second = _run_twice(fn, seed=123)
    _assert_bitwise_equal(first, second)
    with same_randomness(124):
        other = fn()
    assert _differs(first, other)


def test_transformer_layer_attention_dropout_goes_through_the_replaced_sdpa(monkeypatch):
    seen, fused = [], []
    replacement = rng._CpuDraws.sdpa
    monkeypatch.setattr(rng._CpuDraws, "sdpa", lambda self, *a, **kw: seen.append(kw.get("dropout_p", a[4] if len(a) > 4 else 0.0))
                        or replacement(self, *a, **kw))
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: fused.append(1) or real(*a, **kw))
    with same_randomness(0):
        _LAYER(_X)
    assert seen == [0.25]  # nn.MultiheadAttention hands its dropout to SDPA in training …
    assert fused == []     # … and the reference formula runs, not the fused kernel


def test_the_stream_does_not_depend_on_dtype_or_device():
    with same_randomness(5):
        f32 = torch.rand(6)
    with same_randomness(5):
        f64 = torch.rand(6, dtype=torch.float64)
    with same_randomness(5):
        bf16 = torch.rand(6, dtype=torch.bfloat16)
    with same_randomness(5):
        meta = torch.rand(6, device="meta")
    assert torch.equal(f64, f32.double()) and torch.equal(bf16, f32.bfloat16())
    assert meta.device.type == "meta" and meta.shape == (6,)


def test_draws_are_the_seeded_cpu_stream():
    with same_randomness(9):
        drawn = torch.randn(2, 3)
    expected = _ORIGINALS[(torch, "randn")]((2, 3), generator=torch.Generator().manual_seed(9))
    assert torch.equal(drawn, expected)


# --------------------------------------------------------------------------------------------
# argument forms


@pytest.mark.parametrize("call", [
    lambda: torch.rand(2, 3),
    lambda: torch.rand((2, 3)),
    lambda: torch.rand([2, 3]),
    lambda: torch.rand(torch.Size([2, 3])),
    lambda: torch.rand(size=(2, 3)),
    lambda: torch.rand(np.int64(2), 3),
    lambda: torch.rand(torch.tensor(2), 3),
], ids=["ints", "tuple", "list", "Size", "size-keyword", "numpy-int", "0-d-tensor"])
def test_rand_size_forms_draw_the_same_numbers(call):
    with same_randomness(3):
        got = call()
    with same_randomness(3):
        want = torch.rand(2, 3)
    assert got.shape == (2, 3) and torch.equal(got, want)


def test_rand_keywords():
    with same_randomness(4):
        x = torch.randn(3, dtype=torch.float64, requires_grad=True)
        out = torch.empty(3)
        y = torch.rand(3, out=out)
        g = torch.Generator().manual_seed(77)
        z = torch.rand(3, generator=g)
    assert x.dtype == torch.float64 and x.requires_grad and x.is_leaf
    assert y is out
    assert torch.equal(z, _ORIGINALS[(torch, "rand")](3, generator=torch.Generator().manual_seed(77)))


@pytest.mark.parametrize("call,shape,low,high", [
    (lambda: torch.randint(10, (200,)), (200,), 0, 10),
    (lambda: torch.randint(3, 9, (200,)), (200,), 3, 9),
    (lambda: torch.randint(3, 9, size=(4, 50)), (4, 50), 3, 9),
    (lambda: torch.randint(9, size=(200,)), (200,), 0, 9),
    (lambda: torch.randint(low=-2, high=2, size=(200,)), (200,), -2, 2),
    (lambda: torch.randint(-2, high=2, size=(200,)), (200,), -2, 2),
    (lambda: torch.randint(high=4, size=[200]), (200,), 0, 4),
])
def test_randint_forms(call, shape, low, high):
    with same_randomness(6):
        x = call()
    assert x.shape == shape and x.dtype == torch.int64
    assert int(x.min()) == low and int(x.max()) == high - 1  # 200 draws hit both ends


def test_randint_matches_torch_for_the_same_generator_state():
    with same_randomness(8):
        got = torch.randint(3, 9, (5,), dtype=torch.int32)
    want = _ORIGINALS[(torch, "randint")](3, 9, (5,), generator=torch.Generator().manual_seed(8))
    assert got.dtype == torch.int32 and torch.equal(got, want.int())


@pytest.mark.parametrize("call,message", [
    (lambda: torch.rand(2, size=(3,)), "both positionally and as size="),
    (lambda: torch.rand(2.5), "size must be an integer"),
    (lambda: torch.rand(2, layout=torch.sparse_coo), "does not support layout"),
    (lambda: torch.randn(2, pin_memory=True), "does not support pin_memory"),
    (lambda: torch.randint((3,)), "needs high and size"),
    (lambda: torch.randint(1, 2, 3, (4,)), "unexpected positional arguments"),
])
def test_unsupported_forms_are_clear_errors(call, message):
    with same_randomness(0):
        with pytest.raises(TypeError, match=message):
            call()


def test_dropout_semantics():
    x = torch.ones(10)
    with same_randomness(0):
        assert F.dropout(x, p=0.5, training=False) is x
        assert F.dropout(x, p=0.0) is x
        assert torch.equal(F.dropout(x, p=1.0), torch.zeros(10))
        y = torch.ones(10)
        assert F.dropout(y, p=0.5, inplace=True) is y
        with pytest.raises(ValueError, match="between 0 and 1"):
            F.dropout(x, p=1.5)


def test_dropout_keeps_one_minus_p_and_scales_by_its_inverse():
    p, n = 0.3, 200_000
    with same_randomness(11):
        y = F.dropout(torch.ones(n), p=p)
    kept = y != 0
    assert abs(kept.float().mean().item() - (1 - p)) < 0.005  # 5σ of a binomial share at n = 2e5
    torch.testing.assert_close(y[kept], torch.full_like(y[kept], 1 / (1 - p)))


# --------------------------------------------------------------------------------------------
# scaled_dot_product_attention


def _qkv(seed=12, batch=2, heads=2, L=4, S=5, d=8, kv_heads=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, L, d, generator=g)
    k = torch.randn(batch, kv_heads or heads, S, d, generator=g)
    v = torch.randn(batch, kv_heads or heads, S, d, generator=g)
    return q, k, v


def test_sdpa_without_dropout_is_the_kernel_installed_before_the_block(monkeypatch):
    # torch's own kernel, or a patch set's fused replacement entered before the block
    q, k, v = _qkv()
    mask = torch.rand(4, 5, generator=torch.Generator().manual_seed(1)) > 0.3
    calls = []
    real = F.scaled_dot_product_attention
    kernel = lambda *a, **kw: calls.append(kw) or real(*a, **kw)  # noqa: E731
    monkeypatch.setattr(F, "scaled_dot_product_attention", kernel)
    with same_randomness(0):
        got = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
        assert len(calls) == 1 and calls[0]["dropout_p"] == 0.0 and calls[0]["scale"] == 0.3
        F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
        assert len(calls) == 1  # with dropout: the reference formula instead
    assert torch.equal(got, real(q, k, v, attn_mask=mask, scale=0.3))
    assert F.scaled_dot_product_attention is kernel


def _reference(q, k, v, keep, p, attn_mask=None, is_causal=False, scale=None):
    """softmax(QKᵀ·scale + mask)·keep/(1-p)·V in float64."""
    q, k, v = q.double(), k.double(), v.double()
    scores = q @ k.transpose(-2, -1) * (scale if scale is not None else 1 / math.sqrt(q.size(-1)))
    if is_causal:
        scores = scores.masked_fill(~torch.ones(q.size(-2), k.size(-2), dtype=torch.bool).tril(), -math.inf)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool else scores + attn_mask.double()
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # fully masked rows attend to nothing
    return (weights * keep.double() / (1 - p)) @ v


def _keep_mask(seed, shape, p):
    """The first mask a fresh ``same_randomness(seed)`` draws."""
    return _ORIGINALS[(torch, "rand")](shape, generator=torch.Generator().manual_seed(seed)) >= p


@pytest.mark.parametrize("kind", ["none", "bool", "float", "causal", "scale", "fully-masked-row"])
def test_sdpa_with_dropout_is_the_reference_formula(kind):
    q, k, v = _qkv()
    p, kwargs = 0.2, {}
    if kind == "bool":
        kwargs["attn_mask"] = torch.rand(4, 5, generator=torch.Generator().manual_seed(2)) > 0.3
        kwargs["attn_mask"][:, 0] = True
    elif kind == "float":
        kwargs["attn_mask"] = torch.randn(2, 1, 4, 5, generator=torch.Generator().manual_seed(3))
    elif kind == "causal":
        kwargs["is_causal"] = True
    elif kind == "scale":
        kwargs["scale"] = 0.05
    elif kind == "fully-masked-row":
        kwargs["attn_mask"] = torch.ones(4, 5, dtype=torch.bool)
        kwargs["attn_mask"][2] = False
    with same_randomness(21):
        got = F.scaled_dot_product_attention(q, k, v, dropout_p=p, **kwargs)
    want = _reference(q, k, v, _keep_mask(21, (2, 2, 4, 5), p), p, **kwargs)
    assert got.dtype == torch.float32 and not got.isnan().any()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    if kind == "fully-masked-row":
        assert torch.equal(got[:, :, 2], torch.zeros(2, 2, 8))
        fused = _ORIGINALS[(F, "scaled_dot_product_attention")](q, k, v, **kwargs)
        assert torch.equal(fused[:, :, 2], torch.zeros(2, 2, 8))  # what torch itself returns


def test_sdpa_with_dropout_and_grouped_query_attention():
    q, k, v = _qkv(heads=4, kv_heads=2)
    with same_randomness(22):
        got = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, enable_gqa=True)
    keep = _keep_mask(22, (2, 4, 4, 5), 0.1)
    want = _reference(q, k.repeat_interleave(2, -3), v.repeat_interleave(2, -3), keep, 0.1)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert got.shape == F.scaled_dot_product_attention(q, k, v, enable_gqa=True).shape


def test_sdpa_dropout_is_unbiased_over_many_draws():
    # E[dropout(W)]·V = W·V: averaging many independent draws converges to the no-dropout output.
    # (Without the 1/(1-p) scaling the mean would be 0.6× too small.)
    q, k, v = _qkv(batch=1, heads=1)
    n, p = 4000, 0.4
    with same_randomness(13):
        draws = F.scaled_dot_product_attention(q.expand(n, -1, -1, -1), k.expand(n, -1, -1, -1),
                                               v.expand(n, -1, -1, -1), dropout_p=p)
    plain = F.scaled_dot_product_attention(q, k, v)[0]
    mean = draws.double().mean(dim=0)
    rel = (torch.linalg.vector_norm(mean - plain.double()) / torch.linalg.vector_norm(plain.double())).item()
    assert rel < 0.05
    unscaled = (mean * (1 - p) - plain.double()).norm() / plain.double().norm()
    assert unscaled > 0.3


# --------------------------------------------------------------------------------------------
# restoring


def test_originals_are_restored_after_the_block_and_on_error():
    before = {key: getattr(*key) for key in REPLACED}
    with same_randomness(0):
        assert all(getattr(*key) is not before[key] for key in REPLACED)
    assert all(getattr(*key) is before[key] for key in REPLACED)
    with pytest.raises(RuntimeError, match="boom"):
        with same_randomness(0):
            raise RuntimeError("boom")
    assert all(getattr(*key) is before[key] for key in REPLACED)


def test_functions_patched_by_others_before_the_block_are_put_back(monkeypatch):
    # e.g. torch_npu's transfer_to_npu wraps torch.rand to map device="cuda" to the NPU
    def wrapper(*args, **kwargs):
        return _ORIGINALS[(torch, "rand")](*args, **kwargs)

    monkeypatch.setattr(torch, "rand", wrapper)
    with same_randomness(0):
        assert torch.rand is not wrapper
    assert torch.rand is wrapper


def test_nested_blocks_restore_the_outer_replacements():
    with same_randomness(1):
        outer = torch.rand
        with same_randomness(2):
            assert torch.rand is not outer
        assert torch.rand is outer
    assert torch.rand is _ORIGINALS[(torch, "rand")]


def test_global_rng_states_are_restored():
    random.seed(31)
    np.random.seed(31)
    torch.manual_seed(31)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(31)
    np.random.seed(31)
    torch.manual_seed(31)
    with same_randomness(5):
        random.random(), np.random.rand(), torch.rand(1), torch.nn.init.normal_(torch.empty(3))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_global_generators_are_seeded_inside():
    with same_randomness(17):
        inside = (random.random(), np.random.rand(), torch.empty(2).uniform_())
    assert inside[:2] == (random.Random(17).random(), np.random.RandomState(17).rand())
    assert torch.equal(inside[2], torch.empty(2).uniform_(generator=torch.Generator().manual_seed(17)))


def test_initialized_device_generators_are_restored(monkeypatch):
    state = {"value": ["s0"], "seeded": []}
    fake = types.SimpleNamespace(
        is_initialized=lambda: True,
        get_rng_state_all=lambda: list(state["value"]),
        set_rng_state_all=lambda s: state.__setitem__("value", list(s)),
        manual_seed_all=lambda seed: state["seeded"].append(seed),  # what torch.manual_seed calls
        _is_in_bad_fork=lambda: False,
    )
    monkeypatch.setattr(torch._C, "_get_privateuse1_backend_name", lambda: "fakedev")
    monkeypatch.setattr(torch, "fakedev", fake, raising=False)
    assert fake in rng._initialized_device_modules()
    with same_randomness(42):
        state["value"] = ["changed inside"]
    assert state["seeded"] == [42]
    assert state["value"] == ["s0"]
    fake.is_initialized = lambda: False
    assert fake not in rng._initialized_device_modules()


def test_seed_must_be_an_integer():
    with pytest.raises(TypeError, match="seed must be an integer"):
        with same_randomness("0"):
            pass
    with pytest.raises(TypeError, match="seed must be an integer"):
        seed_everything(1.5)
    with same_randomness(np.int64(3)):
        a = torch.rand(2)
    with same_randomness(3):
        assert torch.equal(a, torch.rand(2))


def test_draws_for_a_device_tensor_are_not_the_models_events_under_an_audit():
    """A dropout mask (and torch.rand(..., device=x.device)) is drawn on the host and copied by the
    plugin so that both sides see the same numbers: an audit of the run records none of it, while a
    draw the model itself leaves on the host (torch.rand without device=) is still recorded."""
    from pytest_npu_parity.audit import DEFAULT_LOGICAL_TARGET, DeviceAudit

    class Model(torch.nn.Module):
        def __init__(self, host_noise: bool) -> None:
            super().__init__()
            self.drop = torch.nn.Dropout(0.25)
            self.host_noise = host_noise

        def forward(self, x):
            y = self.drop(x) + torch.rand(x.shape, device=x.device) + torch.randn_like(x)
            if self.host_noise:
                y = y + torch.rand(x.shape[-1])  # the model's own bug: a host draw mixed in
            return y

    for host_noise in (False, True):
        audit = DeviceAudit(DEFAULT_LOGICAL_TARGET, logical=True)
        model = audit.to_target(Model(host_noise).train())
        x = audit.to_target(torch.ones(4, 8))
        with same_randomness(0), audit:
            out = model(x)
        assert audit.device_of(out) == torch.device(DEFAULT_LOGICAL_TARGET)
        kinds = {(e.kind, e.op) for e in audit.record.events}
        if host_noise:
            assert kinds == {("cpu_fallback", "aten::rand.generator"), ("mixed_device", "aten::add.Tensor")}, \
                audit.record.format()
        else:
            assert kinds == set(), audit.record.format()
        with same_randomness(0):
            plain = Model(host_noise).train()(torch.ones(4, 8))
        assert torch.equal(out, plain)


# --------------------------------------------------------------------------------------------
# device mode: each side its own generators


def test_own_randomness_seeds_without_replacing_and_restores():
    before = {(owner, name): getattr(owner, name) for owner, name in REPLACED}
    state, py_state, np_state = torch.random.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    with rng.own_randomness(7):
        assert all(getattr(owner, name) is fn for (owner, name), fn in before.items())  # nothing replaced
        first = torch.randn(4), random.random(), np.random.rand()
    with rng.own_randomness(7):
        second = torch.randn(4), random.random(), np.random.rand()
    assert torch.equal(first[0], second[0]) and first[1:] == second[1:]
    torch.manual_seed(7)
    assert torch.equal(torch.randn(4), first[0])  # torch's own CPU generator, seeded
    torch.random.set_rng_state(state)
    with rng.own_randomness(7):
        pass
    assert torch.equal(torch.random.get_rng_state(), state) and random.getstate() == py_state
    assert (np.random.get_state()[1] == np_state).all()


def test_target_seed_is_reproducible_in_range_and_independent():
    seeds = [rng.target_seed(s) for s in range(100)]
    assert seeds == [rng.target_seed(s) for s in range(100)]
    assert all(0 <= s < 2**63 for s in seeds) and len(set(seeds)) == 100
    assert not set(seeds) & set(range(101))
    with pytest.raises(TypeError):
        rng.target_seed(1.5)


def test_randomness_picks_the_mode():
    with rng.randomness("shared", 3):
        assert torch.randn is not _ORIGINALS[(torch, "randn")]
    with rng.randomness("device", 3):
        assert torch.randn is _ORIGINALS[(torch, "randn")]
    with pytest.raises(ValueError, match="use one of shared, device"):
        rng.randomness("cpu", 0)


def test_the_block_says_what_was_in_place_and_which_stand_ins_were_called(monkeypatch):
    def own_dropout(x, p=0.5, training=True, inplace=False):
        raise AssertionError("never runs inside the block")

    q = torch.randn(1, 2, 4, 8)
    kernel = _ORIGINALS[(F, "scaled_dot_product_attention")]
    monkeypatch.setattr(F, "dropout", own_dropout)
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: kernel(*a, **k))
    before = rng.random_functions()
    assert before["torch.nn.functional.dropout"] is own_dropout and before["torch.rand"] is _ORIGINALS[(torch, "rand")]
    with same_randomness(0) as stand_ins:
        assert stand_ins.found == before and stand_ins.used == set()
        F.dropout(q, 0.1)
        F.scaled_dot_product_attention(q, q, q)  # without dropout the function found in place runs
        assert stand_ins.used == {"torch.nn.functional.dropout"}
        F.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
        torch.rand(3)
    assert stand_ins.used == {"torch.nn.functional.dropout", "torch.nn.functional.scaled_dot_product_attention",
                              "torch.rand"}
