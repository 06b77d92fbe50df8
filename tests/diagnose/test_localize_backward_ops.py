"""Down to the op in the backward: a wrong backward kernel in one layer is named by its aten name.

A train step whose backward table (``localize.backward``) names a layer as local gets the op trace of
that layer's call, forward and backward (``op_trace.trace_ops(..., backward=...)``), on the reference's
inputs and grad_output: each backward kernel is compared with its float64 golden and labelled with the
forward line that created its autograd node. Planted on the target only: ``aten.sigmoid_backward`` 1e-3
off (the middle layer is the only one with a sigmoid), so the forward and the loss agree and only the
gradients differ.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from pytest_npu_parity.compare import ParityError
from pytest_npu_parity.diagnose.localize import failure_hook
from pytest_npu_parity.diagnose.op_trace import trace_ops
from pytest_npu_parity.runner import ParityCase, ParitySession

aten = torch.ops.aten


class Layer(torch.nn.Module):
    def __init__(self, width: int, act: str):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return torch.sigmoid(h) if self.act == "sigmoid" else torch.tanh(h)


class Chain(torch.nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.layers = torch.nn.ModuleList([Layer(width, a) for a in ("tanh", "sigmoid", "tanh")])
        self.head = torch.nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class _WrongBackwardKernel(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is aten.sigmoid_backward.default:
            with _disable_current_modes():
                return out * (1 + 1e-3)
        return out


def _x() -> torch.Tensor:
    return torch.randn(5, 8, generator=torch.Generator().manual_seed(1))


def test_a_wrong_backward_kernel_is_named_by_the_backward_op_trace():
    torch.manual_seed(0)
    model = Chain()
    session = ParitySession(torch.device("cpu"), reference="cpu", failure_hooks=[failure_hook],
                            recipe_policies={"fp32": "allclose"})
    case = ParityCase(session, "t::bwd-kernel", patches=lambda device: _WrongBackwardKernel())
    with pytest.raises(ParityError) as info:
        case.train_step("step", model, {"x": _x()}, loss_fn=lambda out: out.square().mean(), max_grad_norm=None)
    message, record = str(info.value), case.records[-1]
    rows = {row["submodule"]: row for row in record.extra["localization_backward"]}
    assert rows["layers.1"]["first_divergence"] and rows["layers.1"]["verdict"] == "local", message
    ops = record.localized.localization_ops
    first = next(row for row in ops if row["first_op"])
    assert first["op"] == "aten.sigmoid_backward" and first["phase"] == "backward", message
    assert first["verdict"] == "local" and first["local"] == pytest.approx(1e-3, rel=0.05), message
    assert first["module"].startswith("layers.1"), message
    assert first["source"].startswith("backward of tests/diagnose/test_localize_backward_ops.py:"), message
    assert "torch.sigmoid(h)" in first["source"], message
    assert "first culprit op: aten.sigmoid_backward" in message


def test_tracing_a_backward_changes_neither_the_outputs_nor_the_gradients():
    torch.manual_seed(0)
    model, x = Chain(), _x()
    params = list(model.parameters())
    out = model(x)
    grads = torch.autograd.grad(out.square().mean(), params)
    trace = trace_ops(model, (x,), device="cpu",
                      backward=lambda y: torch.autograd.grad(y.square().mean(), params))
    assert torch.equal(trace.output, out)
    assert all(torch.equal(a, b) for a, b in zip(trace.backward_output, grads))
    backward = [r for r in trace.rows if r.phase == "backward"]
    assert any(r.op == "aten.sigmoid_backward" for r in backward) and trace.first is None
    named = next(r for r in backward if r.op == "aten.sigmoid_backward")
    assert named.module.startswith("layers.1") and "torch.sigmoid(h)" in named.source


class GeluChain(torch.nn.Module):
    """Linear -> GELU -> Linear: the layer whose backward differs is a torch module (``nn.GELU``)."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.inp, self.act, self.out = torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.inp(x)))


class _WrongGeluBackward(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is aten.gelu_backward.default:
            with _disable_current_modes():
                return out * (1 + 1e-2)
        return out


def test_the_backward_op_of_a_torch_module_is_sourced_at_its_forward_not_at_the_callers_line():
    """``nn.GELU`` traced alone has no model line inside the traced call: its backward op's source is the
    torch module's forward, as its forward op's is. The anomaly stack walk used to run past the trace's own
    frame and name the caller's line (this file's ``train_step`` call)."""
    torch.manual_seed(0)
    session = ParitySession(torch.device("cpu"), reference="cpu", failure_hooks=[failure_hook],
                            recipe_policies={"fp32": "allclose"})
    case = ParityCase(session, "t::gelu-bwd", patches=lambda device: _WrongGeluBackward())
    with pytest.raises(ParityError) as info:
        case.train_step("step", GeluChain(), {"x": _x()}, loss_fn=lambda out: out.square().mean(), max_grad_norm=None)
    message = str(info.value)
    first = next(row for row in case.records[-1].localized.localization_ops if row["first_op"])
    assert first["op"] == "aten.gelu_backward" and first["module"] == "act", message
    assert first["source"].startswith("backward of torch/nn/modules/activation.py:"), message
    assert "F.gelu(" in first["source"], message


class GatedMLP(torch.nn.Module):
    """``down(act(gate(x)) * up(x))`` as Llama's MLP: ``act``'s and ``up``'s outputs meet in one mul."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.gate, self.up, self.down = (torch.nn.Linear(width, 2 * width), torch.nn.Linear(width, 2 * width),
                                         torch.nn.Linear(2 * width, width))
        self.act = torch.nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate(x)) * self.up(x))


class GatedBlock(torch.nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.norm, self.mlp = torch.nn.LayerNorm(width), GatedMLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class GatedChain(torch.nn.Module):
    """The gated MLP two levels down, as in a decoder layer: the backward table names ``block``, whose
    trace holds ``mlp.act`` and ``mlp.up``."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.inp, self.block, self.out = torch.nn.Linear(width, width), GatedBlock(width), torch.nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(torch.tanh(self.inp(x))))


class _WrongSiluBackward(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is aten.silu_backward.default:
            with _disable_current_modes():
                return out * (1 + 1e-2)
        return out


def test_a_backward_op_is_put_in_the_module_whose_forward_created_it():
    """In ``act(gate(x)) * up(x)`` the backward of the mul reaches ``act`` and ``up`` at once, and
    ``ModuleTracker``'s guess put ``aten.silu_backward`` in ``block.mlp.up`` (as in a tiny Llama's
    ``mlp.up_proj``); the op's autograd node, tagged in the forward (``node_modules``), puts it in
    ``block.mlp.act``."""
    torch.manual_seed(0)
    session = ParitySession(torch.device("cpu"), reference="cpu", failure_hooks=[failure_hook],
                            recipe_policies={"fp32": "allclose"})
    case = ParityCase(session, "t::silu-bwd", patches=lambda device: _WrongSiluBackward())
    with pytest.raises(ParityError) as info:
        case.train_step("step", GatedChain(), {"x": _x()}, loss_fn=lambda out: out.square().mean(), max_grad_norm=None)
    message = str(info.value)
    first = next(row for row in case.records[-1].localized.localization_ops if row["first_op"])
    assert first["op"] == "aten.silu_backward" and first["phase"] == "backward", message
    assert first["module"] == "block.mlp.act", message
    assert "first culprit op: aten.silu_backward (in block.mlp.act, backward of " in message
    assert "self.act(self.gate(x)) * self.up(x)" in first["source"], message  # the model line calling act
