"""Program difference: the ops the target runs that the reference does not, on the CPU as the target.

Causes are planted on the target side only, through the case's patch factory (as in
tests/diagnose/test_op_trace.py): a code change that the patch set makes while the target runs (a cast
inserted before a softmax, a LayerNorm computed by hand, a scale multiplication left out), or a
wrong kernel (a dispatch mode below the recorder) that changes values but not which ops run.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from pytest_npu_parity.baselines import BaselineStore
from pytest_npu_parity.compare import ParityError
from pytest_npu_parity.diagnose import op_stream
from pytest_npu_parity.diagnose.op_stream import IGNORED, OpRecorder, compare_streams, record_ops
from pytest_npu_parity.diagnose.op_trace import trace_ops
from pytest_npu_parity.localize import failure_hook
from pytest_npu_parity.recipes import RECIPES
from pytest_npu_parity.rng import same_randomness
from pytest_npu_parity.runner import ParityCase, ParitySession
from switches import attribute_set

aten = torch.ops.aten
HERE = "tests/diagnose/test_op_stream.py:"


class Attention(torch.nn.Module):
    """Single-head attention whose scale and softmax live in its own code."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.q = torch.nn.Linear(width, width)
        self.k = torch.nn.Linear(width, width)
        self.v = torch.nn.Linear(width, width)
        self.scale = 1 / math.sqrt(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        scores = q @ k.transpose(-1, -2) * self.scale
        return self.softmax(scores) @ v

    def softmax(self, scores: torch.Tensor) -> torch.Tensor:
        return torch.softmax(scores, dim=-1)


class Net(torch.nn.Module):
    """Linear -> LayerNorm -> Attention -> Linear."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.inp = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)
        self.attn = Attention(width)
        self.out = torch.nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.attn(self.norm(self.inp(x))))


@pytest.fixture
def net() -> Net:
    torch.manual_seed(0)
    return Net().eval()


@pytest.fixture
def x() -> torch.Tensor:
    return torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1))


def _session() -> ParitySession:
    return ParitySession(torch.device("cpu"), reference="cpu", failure_hooks=[failure_hook],
                         recipe_policies={"fp32": "allclose", "bf16": "allclose"})


def _fail(case: ParityCase, *args, **kwargs) -> tuple[str, dict]:
    with pytest.raises(ParityError) as info:
        case.check(*args, **kwargs)
    return str(info.value), case.records[-1].extra


def _stream_rows(extra: dict) -> list[dict]:
    return [r for r in extra.get("localization_ops") or [] if r["kind"] == "op_stream"]


class _Kernel(TorchDispatchMode):
    """A wrong kernel on the target: ``wrong`` computes the ops in ``ops`` with the modes off."""

    def __init__(self, ops, wrong):
        super().__init__()
        self.ops, self.wrong = set(ops), wrong

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.ops:
            with _disable_current_modes():
                return self.wrong(func, args, kwargs)
        return func(*args, **kwargs)


# --------------------------------------------------------------------------------------------
# planted program differences are named: what changed, the op, module path and source line


def test_a_cast_inserted_before_the_softmax_is_named_with_its_line(net, x):
    def half_softmax(self, scores):
        return torch.softmax(scores.half(), dim=-1).float()

    case = ParityCase(_session(), "t::cast", patches=lambda device: attribute_set(Attention, "softmax", half_softmax))
    message, extra = _fail(case, "net", net, x)
    assert "First divergence: attn (Attention), in its own code outside its submodules" in message
    rows = _stream_rows(extra)
    assert rows and all(r["change"] == "inserted" and r["side"] == "target" for r in rows), rows
    first = rows[0]
    assert first["op"] == "aten._to_copy" and first["module"] == "attn"
    assert first["input_dtypes"] == ["float32"] and first["dtype"] == "float16"
    assert first["source"].startswith(HERE) and "torch.softmax(scores.half(), dim=-1).float()" in first["source"]
    line = next(ln for ln in message.splitlines() if ln.startswith("Program difference"))
    assert f"first at target op #{first['op_index']}: inserted aten._to_copy float32->float16 (in attn, {HERE}" in line
    assert "before reference op" in line and "(aten._softmax)" in line
    # the line comes after the op trace's section
    assert message.index("Op trace of attn (Attention)") < message.index("Program difference")


def test_a_layer_norm_computed_by_hand_is_named_as_replaced(net, x):
    def by_hand(self, t):  # the port's LayerNorm: torch.var's default is the unbiased variance
        mean = t.mean(-1, keepdim=True)
        var = t.var(-1, keepdim=True)
        return (t - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias

    case = ParityCase(_session(), "t::hand-norm",
                      patches=lambda device: attribute_set(torch.nn.LayerNorm, "forward", by_hand))
    message, extra = _fail(case, "net", net, x)
    assert "First divergence: norm (LayerNorm)" in message
    rows = _stream_rows(extra)
    ref = [r for r in rows if r["side"] == "reference"]
    tgt = [r for r in rows if r["side"] == "target"]
    assert all(r["change"] == "replaced" for r in rows)
    assert [r["op"] for r in ref] == ["aten.native_layer_norm"] and "F.layer_norm" in ref[0]["source"]
    assert tgt[0]["op"] == "aten.mean" and tgt[0]["module"] == "norm"
    assert tgt[0]["source"].startswith(HERE) and "t.mean(-1, keepdim=True)" in tgt[0]["source"]
    assert "aten.native_layer_norm" not in {r["op"] for r in tgt}
    line = next(ln for ln in message.splitlines() if ln.startswith("Program difference"))
    assert f"first at target op #{tgt[0]['op_index']}: aten.native_layer_norm float32->float32 of the reference" in line
    assert "replaced by" in line and "aten.mean float32->float32" in line


def test_a_scale_multiplication_left_out_is_named_as_removed_with_the_references_line(net, x):
    def unscaled(self, t):
        q, k, v = self.q(t), self.k(t), self.v(t)
        return self.softmax(q @ k.transpose(-1, -2)) @ v  # the port forgot the scale

    case = ParityCase(_session(), "t::no-scale", patches=lambda device: attribute_set(Attention, "forward", unscaled))
    message, extra = _fail(case, "net", net, x)
    assert "First divergence: attn (Attention)" in message
    rows = _stream_rows(extra)
    assert len(rows) == 1 and rows[0]["change"] == "removed" and rows[0]["side"] == "reference", rows
    assert rows[0]["op"] == "aten.mul" and rows[0]["module"] == "attn"
    assert rows[0]["source"].startswith(HERE) and "q @ k.transpose(-1, -2) * self.scale" in rows[0]["source"]
    line = next(ln for ln in message.splitlines() if ln.startswith("Program difference"))
    assert f"first at reference op #{rows[0]['op_index']}: removed aten.mul float32->float32 (in attn, {HERE}" in line
    assert "the target runs nothing before target op" in line and "(aten._softmax)" in line


def test_a_wrong_kernel_runs_the_same_op_stream(net, x):
    def off_by_1e4(func, args, kwargs):
        return func(*args, **kwargs) * (1 + 1e-4)

    case = ParityCase(_session(), "t::kernel", patches=lambda device: _Kernel({aten.bmm.default}, off_by_1e4))
    message, extra = _fail(case, "net", net, x)
    assert "first culprit op: aten.bmm" in message  # the op trace names the kernel
    assert ("ops): same op stream (names and dtypes): the difference is in the values, not in which ops run"
            in message)
    assert _stream_rows(extra) == []
    assert extra["localization_ops"][0]["first_op"]  # the op table is unchanged: the culprit op first


def test_against_a_baseline_the_reference_stream_is_the_live_cpu_runs(net, x, tmp_path):
    store = BaselineStore(tmp_path, "toy")
    recorder = ParitySession(torch.device("cpu"), reference="cpu", update_baselines=True, store=store)
    case = ParityCase(recorder, "tests/test_toy.py::test_net")
    case.check("net", net, x)
    assert case.finish() == "created"
    session = ParitySession(torch.device("cpu"), reference="baseline", store=store, failure_hooks=[failure_hook])

    def unscaled(self, t):
        q, k, v = self.q(t), self.k(t), self.v(t)
        return self.softmax(q @ k.transpose(-1, -2)) @ v

    case = ParityCase(session, "tests/test_toy.py::test_net",
                      patches=lambda device: attribute_set(Attention, "forward", unscaled))
    message, extra = _fail(case, "net", net, x)
    assert "removed aten.mul float32->float32 (in attn" in message
    assert ("the program difference compares the target's op stream with that of the live CPU run this localization "
            "uses as its reference: a stored baseline holds no op stream") in message


# --------------------------------------------------------------------------------------------
# recording changes nothing; a correct model has no program difference


class Noisy(torch.nn.Module):
    """Dropout (random), in-place ops, a view, a factory and an ``.item()``."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.drop = torch.nn.Dropout(0.3)

    def forward(self, t):
        y = self.drop(self.lin(t))
        y.relu_()
        y = y.masked_fill(y > 1.5, 0.0)
        scale = float(y.abs().max().item()) + 1.0
        return (y.transpose(-1, -2) / scale + torch.randn_like(y.transpose(-1, -2))).sum(-1)


@pytest.mark.parametrize("recipe", ["fp32", "bf16"])
def test_a_correct_model_has_no_difference_and_recording_changes_no_output(recipe, net, x):
    torch.manual_seed(0)
    noisy = Noisy().train()
    device = torch.device("cpu")
    for module in (net, noisy):
        with same_randomness(7), RECIPES[recipe].context(device):
            plain = module(x)
        with same_randomness(7), RECIPES[recipe].context(device):
            reference = record_ops(module, (x,), path="m")
        # the target's way: recorded below an op trace, which runs its float64 goldens with the modes off
        with same_randomness(7), RECIPES[recipe].context(device), OpRecorder(module, "m") as recorder:
            traced = trace_ops(module, (x,), device=device, recipe=RECIPES[recipe], path="m", enter_recipe=False)
        for out in (reference.output, traced.output):
            assert out.dtype == plain.dtype and torch.equal(out, plain)  # bitwise
        target = recorder.stream
        assert reference.failed is None and target.failed is None
        # no golden op was recorded (views left out: torch 2.5.1's ModuleTracker adds detach/view ops of its own)
        assert [o.key for o in reference.ops if o.op not in IGNORED] == [o.key for o in target.ops if o.op not in IGNORED]
        assert len(target.ops) == target.dispatched
        assert len([o for o in target.ops if o.op not in IGNORED]) == len([r for r in traced.rows if r.op not in IGNORED])
        diff = compare_streams(reference, target)
        assert diff.change is None and diff.blocks == 0 and diff.to_rows() == [], diff.summary()
        assert diff.reference_ops == len([o for o in reference.ops if o.op not in IGNORED]) > 0
        assert "same op stream" in diff.summary()


def test_a_check_that_passes_records_nothing(net, x, monkeypatch):
    calls = []
    monkeypatch.setattr(op_stream, "record_ops", lambda *a, **k: calls.append(1))
    ParityCase(_session(), "t::green").check("net", net, x)
    assert calls == []


def test_views_are_left_out_and_shapes_compared_apart():
    class Reshaper(torch.nn.Module):
        def __init__(self, transposed: bool, shape: tuple):
            super().__init__()
            self.transposed, self.shape = transposed, shape

        def forward(self, t):
            t = t.transpose(0, 1).contiguous().transpose(0, 1) if self.transposed else t
            return (t * 2).reshape(self.shape).exp()

    t = torch.randn(4, 6)
    plain = record_ops(Reshaper(False, (24,)), (t,))
    viewed = record_ops(Reshaper(True, (24,)), (t,))  # adds transposes and a clone
    diff = compare_streams(plain, viewed)
    assert diff.change == "inserted" and [o.op for o in diff.target] == ["aten.clone"]
    assert not any(o.op in IGNORED for o in diff.target)
    other_shape = compare_streams(plain, record_ops(Reshaper(False, (6, 4)), (t,)))
    assert other_shape.change == "shape" and other_shape.target[0].op == "aten.exp"
    assert "gives shape [6, 4] where the reference gives [24]" in other_shape.summary()


def test_the_same_op_with_another_dtype_is_named():
    class Exp(torch.nn.Module):
        def __init__(self, dtype):
            super().__init__()
            self.dtype = dtype

        def forward(self, t):
            return torch.exp(t.to(self.dtype)).sum()

    t = torch.randn(5, dtype=torch.float64)
    diff = compare_streams(record_ops(Exp(torch.float32), (t,)), record_ops(Exp(torch.bfloat16), (t,)))
    # the cast exists on both sides, with another output dtype: the same op, other dtypes
    assert diff.change == "dtype" and diff.target[0].op == "aten._to_copy"
    assert "aten._to_copy runs float64->bfloat16 where the reference runs float64->float32" in diff.summary()


# --------------------------------------------------------------------------------------------
# a recording that fails never hides the check's failure


def test_a_failing_recording_leaves_the_check_failing_with_a_note(net, x, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no frames here")

    monkeypatch.setattr(op_stream, "_user_frame", broken)  # every op's record raises
    case = ParityCase(_session(), "t::broken", patches=lambda device: _Kernel(
        {aten.bmm.default}, lambda func, args, kwargs: func(*args, **kwargs) * 1.01))
    message, extra = _fail(case, "net", net, x)
    assert "first culprit op: aten.bmm" in message  # the op trace is unharmed
    assert "no program difference of attn: recording the target's op stream failed (RuntimeError: no frames here)" \
        in message
    assert "Program difference (" not in message and _stream_rows(extra) == []


def test_a_reference_that_cannot_be_recorded_gets_a_note(net, x, monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("reference run failed")

    monkeypatch.setattr(op_stream, "record_ops", broken)
    case = ParityCase(_session(), "t::ref-broken", patches=lambda device: _Kernel(
        {aten.bmm.default}, lambda func, args, kwargs: func(*args, **kwargs) * 1.01))
    message, _ = _fail(case, "net", net, x)
    assert ("no program difference of attn: recording the reference's op stream raised (ValueError: reference run "
            "failed)") in message
