"""Under a golden verdict (every bf16 check) the root cause's ops are traced: a wrong kernel is named.

The first-divergence localization judges submodule outputs by allclose, so a golden-verdict failure is
not localized and its op trace used to be missing. The counterfactual attribution names the root-cause
module; one more re-run then traces that module's ops (``counterfactual.trace_root_cause``) at the
recipe's precision. Planted on the target only: a softmax kernel 5 % off inside the attention (far beyond
bfloat16's budget of 2⁻⁷ ≈ 7.8e-3), and, as the control, a fragile port whose every op is correct (the
moments computed with bf16 matmuls: an algorithm problem, no kernel to blame).
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from counterfactual_models import fragile_moments, norm_input, norm_net
from pytest_npu_parity.compare import ParityError
from pytest_npu_parity.localize import Localizer
from pytest_npu_parity.runner import ParityCase, ParitySession

aten = torch.ops.aten


class Attention(torch.nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.q = torch.nn.Linear(width, width)
        self.k = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2) / 4.0
        return torch.softmax(scores, dim=-1) @ x


class Model(torch.nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.embed = torch.nn.Linear(width, width)
        self.attn = Attention(width)
        self.head = torch.nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(torch.tanh(self.embed(x))))


class _SoftmaxOff(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is aten._softmax.default:
            with _disable_current_modes():
                return out * 1.05
        return out


def _session() -> ParitySession:
    return ParitySession(torch.device("cpu"), reference="cpu", failure_hooks=[Localizer(None)])


def _fails(case: ParityCase, *args) -> str:
    with pytest.raises(ParityError) as info:
        case.check(*args)
    return str(info.value)


def test_a_wrong_softmax_kernel_in_a_bf16_check_is_named_by_the_root_causes_op_trace():
    torch.manual_seed(0)
    model, x = Model().eval(), torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1))
    case = ParityCase(_session(), "t::softmax", "bf16", patches=lambda device: _SoftmaxOff())
    message = _fails(case, "m", model, x)
    record = case.records[-1]
    assert record.golden_policy is not None, message  # judged by the golden verdict, not localized
    rows = {r["suspect"]: r for r in record.whatfix.counterfactual if r["kind"] == "counterfactual"}
    assert rows["attn (Attention)"]["verdict"] == "root cause", message
    first = next(r for r in record.localized.localization_ops if r["first_op"])
    assert first["op"] == "aten._softmax" and first["module"] == "attn" and first["verdict"] == "local", message
    assert first["local"] == pytest.approx(0.05, rel=0.05), message  # the planted error, measured
    assert "torch.softmax(scores, dim=-1)" in first["source"], message
    assert first["budget"] == pytest.approx(2 ** -7)  # judged at the recipe's precision (bf16), not float32's
    assert "Op trace of the root cause" in message and "first culprit op: aten._softmax (in attn" in message


def test_a_fragile_port_with_correct_kernels_gets_an_op_trace_that_blames_no_kernel():
    model, x = norm_net(), norm_input()
    case = ParityCase(_session(), "t::fragile", "bf16", patches=fragile_moments)
    message = _fails(case, "m", model, x)
    ops = case.records[-1].localized.localization_ops
    assert ops is not None and not any(r["first_op"] for r in ops), message
    assert "Op trace of the root cause" in message and "every op compared is within its budget" in message
    assert 'fp32_islands(model, ["blocks.1.norm"])' in message  # what does fix it: the island


def test_without_a_root_cause_module_no_op_trace_is_run():
    torch.manual_seed(0)
    model, x = Model().eval(), torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1))
    calls = []
    handle = model.attn.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        case = ParityCase(_session(), "t::clean", "bf16")
        case.check("m", model, x)  # passes: no diagnosis, no trace
    finally:
        handle.remove()
    assert case.records[-1].localized.localization_ops is None
    assert len(calls) == 3  # reference, target and golden runs only


@pytest.mark.parametrize("recipe", ["fp32", "bf16"])
def test_the_traced_call_computes_bitwise_what_the_call_itself_computes(recipe):
    """The trace of the root cause does not change what it measures: its traced call, run from the call's
    own inputs in the run's own context, returns bitwise the submodule's output in that run, and the run's
    output is bitwise a plain run's (this model draws no random numbers and keeps no running statistics)."""
    from pytest_npu_parity.diagnose.counterfactual import op_traced
    from pytest_npu_parity.recipes import RECIPES

    torch.manual_seed(0)
    model, x = Model().eval(), torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1))
    rec = RECIPES[recipe]
    seen = []
    handle = model.attn.register_forward_hook(lambda m, a, out: seen.append(out))
    try:
        with torch.no_grad(), rec.context(torch.device("cpu")):
            plain = model(x)
            found: list = []
            with op_traced(model, "attn", found, device="cpu", recipe=rec, path="attn"):
                traced_run = model(x)
    finally:
        handle.remove()
    assert len(found) == 1 and found[0].ops > 0
    assert torch.equal(found[0].output, seen[-1])  # the traced call vs the call itself, same run
    assert torch.equal(traced_run, plain) and torch.equal(seen[0], seen[-1])


class Shared(torch.nn.Module):
    """One Linear called twice: on the embedding (values beyond [-1, 1]) and on a tanh of its own output."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.embed = torch.nn.Linear(8, width)
        self.shared = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.shared(self.embed(x) * 3))
        return self.head(torch.tanh(self.shared(h)))


class _SecondCallOff(TorchDispatchMode):
    """An addmm kernel 5 % off for a 16 x 16 weight and an input within [-1, 1]: ``shared``'s second call only."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is aten.addmm.default and args[2].shape == (16, 16) and bool(args[1].abs().max() <= 1):
            with _disable_current_modes():
                return out * 1.05
        return out


def _shared_and_input():
    torch.manual_seed(0)
    return Shared().eval(), torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(1))


def test_a_module_computing_wrongly_in_its_second_call_only_is_traced_in_that_call():
    """The root cause ``shared`` is called twice; its first call is right. Tracing the first call alone said
    "every op compared is within its budget" (no kernel to blame); the calls are traced until one has a
    culprit op, and that call is named as the localization names calls (``shared#1``)."""
    model, x = _shared_and_input()
    case = ParityCase(_session(), "t::second-call", "bf16", patches=lambda device: _SecondCallOff())
    message = _fails(case, "m", model, x)
    record = case.records[-1]
    rows = {r["suspect"]: r for r in record.whatfix.counterfactual if r["kind"] == "counterfactual"}
    assert rows["shared (Linear)"]["verdict"] == "root cause", message
    first = next(r for r in record.localized.localization_ops if r["first_op"])
    assert first["op"] == "aten.addmm" and first["module"] == "shared" and first["verdict"] == "local", message
    assert first["local"] == pytest.approx(0.05, rel=0.05), message
    assert "Op trace of shared#1 (Linear)" in message and "2 calls of shared traced" in message


@pytest.mark.parametrize("recipe", ["fp32", "bf16"])
def test_tracing_every_call_of_a_shared_module_leaves_the_run_bitwise_plain(recipe):
    from pytest_npu_parity.diagnose.counterfactual import op_traced
    from pytest_npu_parity.recipes import RECIPES

    model, x = _shared_and_input()
    rec = RECIPES[recipe]
    with torch.no_grad(), rec.context(torch.device("cpu")):
        plain = model(x)
        found: list = []
        with op_traced(model, "shared", found, device="cpu", recipe=rec, path="shared"):
            traced_run = model(x)
    assert len(found) == 2 and all(t.first is None for t in found)  # no fault: both calls traced, no culprit
    assert torch.equal(traced_run, plain)


class _TanhOff(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is aten.tanh.default:
            with _disable_current_modes():
                return out * 1.05
        return out


def test_a_wrong_kernel_in_the_modules_own_code_is_named_by_the_trace_of_the_whole_module():
    """``Model``'s tanh runs in its own code, outside every child: no child suspect is the root cause, and
    the op trace used to be skipped. The check's whole module is traced instead and names ``aten.tanh``."""
    torch.manual_seed(0)
    model, x = Model().eval(), torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1))
    case = ParityCase(_session(), "t::tanh", "bf16", patches=lambda device: _TanhOff())
    message = _fails(case, "m", model, x)
    record = case.records[-1]
    rows = [r for r in record.whatfix.counterfactual if r["kind"] == "counterfactual" and r["suspect_kind"] == "module"]
    assert rows and not any(r["verdict"] == "root cause" for r in rows), message
    first = next(r for r in record.localized.localization_ops if r["first_op"])
    assert first["op"] == "aten.tanh" and first["module"] == "<Model>" and first["verdict"] == "local", message
    assert "torch.tanh(self.embed(x))" in first["source"], message
    assert "Op trace of the check's module" in message and "the check's whole module was traced" in message


class _ResidualTwice(Attention):
    """The target's port of the attention adds its input twice (a program difference, every kernel right)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out + x if PORT["on"] else out


PORT = {"on": False}


def test_a_program_difference_in_the_root_cause_is_named_under_the_golden_verdict():
    torch.manual_seed(0)
    model, x = Model().eval(), torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1))
    model.attn.__class__ = _ResidualTwice

    def port(device):
        import contextlib

        @contextlib.contextmanager
        def on():
            PORT["on"] = True
            try:
                yield
            finally:
                PORT["on"] = False
        return on()

    case = ParityCase(_session(), "t::residual", "bf16", patches=port)
    message = _fails(case, "m", model, x)
    record = case.records[-1]
    assert record.golden_policy is not None, message
    ops = record.localized.localization_ops
    assert not any(r.get("first_op") for r in ops if r["kind"] == "op"), message  # every kernel computed right
    stream = [r for r in ops if r["kind"] == "op_stream"]
    assert stream and stream[0]["change"] == "inserted" and stream[0]["op"] == "aten.add", message
    assert "return out + x if PORT" in stream[0]["source"], message
    assert "Program difference (reference vs target op streams" in message and "inserted aten.add" in message
