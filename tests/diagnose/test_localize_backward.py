"""The backward pass of a failing train step, layer by layer: which layer's own backward differs.

Each test plants a backward-only cause on the target side, through the case's patch factory (the
flag ``FAULT`` is on only while the target runs): a custom autograd Function whose forward is the
identity and whose backward scales the gradient by 1.5, or a ``.detach()`` on one branch. The
forward therefore agrees everywhere (the loss too), and the table must name the layer whose own
(local) backward is out of tolerance — not the first layer, whose gradients merely inherit it.
"""
from __future__ import annotations

import contextlib
import time

import pytest
import torch

from pytest_npu_parity.compare import ParityError
from pytest_npu_parity.diagnose.localize import Localization, failure_hook
from pytest_npu_parity.diagnose.localize.backward import backward_table, call_gradients, grad_pass
from pytest_npu_parity.diagnose.localize.sides import _Side
from pytest_npu_parity.runner import ParityCase, ParitySession

#: On while the target side runs (the patch factory sets it): the planted faults apply there only.
FAULT = {"on": False}


@contextlib.contextmanager
def _target_fault(device):
    FAULT["on"] = True
    try:
        yield
    finally:
        FAULT["on"] = False


class _ScaledBackward(torch.autograd.Function):
    """Identity forward, gradient × 1.5 backward: a port's wrong backward kernel."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 1.5


class Layer(torch.nn.Module):
    """tanh(Linear(x)); with ``fault`` set, the target scales the gradient at its ``input`` (what it
    passes on) or its ``output`` (everything it computes backward)."""

    def __init__(self, width: int = 8, fault: str | None = None):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)
        self.fault = fault

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if FAULT["on"] and self.fault == "input":
            x = _ScaledBackward.apply(x)
        y = torch.tanh(self.lin(x))
        if FAULT["on"] and self.fault == "output":
            y = _ScaledBackward.apply(y)
        return y


class Chain(torch.nn.Module):
    """Layers (a dropout of ``p`` after each), then a Linear head."""

    def __init__(self, faults: tuple = (None, None, None), width: int = 8, p: float = 0.0):
        super().__init__()
        self.layers = torch.nn.ModuleList([Layer(width, f) for f in faults])
        self.drop = torch.nn.Dropout(p)
        self.head = torch.nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = self.drop(layer(x))
        return self.head(x)


class TwoBranch(torch.nn.Module):
    """a(x) + b(x); the target cuts b's gradient to x (``x.detach()``) when ``cut``."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.a = torch.nn.Linear(width, width)
        self.b = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x.detach() if FAULT["on"] else x)


class Branchy(torch.nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.pre = torch.nn.Linear(width, width)
        self.block = TwoBranch(width)
        self.head = torch.nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.block(torch.tanh(self.pre(x)))))


def _session() -> ParitySession:
    return ParitySession(torch.device("cpu"), reference="cpu", failure_hooks=[failure_hook],
                         recipe_policies={"fp32": "allclose"})


def _x() -> torch.Tensor:
    return torch.randn(5, 8, generator=torch.Generator().manual_seed(1))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _step(model: torch.nn.Module, inputs: dict, **kwargs) -> tuple[str, dict[str, dict]]:
    """The failure message and the backward rows by submodule of a train step planted with ``FAULT``."""
    case = ParityCase(_session(), "t::bwd", patches=_target_fault)
    kwargs.setdefault("loss_fn", _loss)
    with pytest.raises(ParityError) as info:
        case.train_step("step", model, inputs, max_grad_norm=None, **kwargs)  # no clipping: keep the scale
    message, extra = str(info.value), case.records[-1].extra
    assert "localization_backward" in extra, message
    return message, {row["submodule"]: row for row in extra["localization_backward"]}


def _first(rows: dict[str, dict]) -> str:
    first = [name for name, row in rows.items() if row["first_divergence"]]
    assert len(first) == 1, rows
    return first[0]


def test_a_scaled_backward_in_layer_0_is_local_and_the_layers_after_it_are_ok():
    torch.manual_seed(0)
    message, rows = _step(Chain(("output", None, None)), {"x": _x()})
    assert _first(rows) == "layers.0"
    assert rows["layers.0"]["verdict"] == "local" and rows["layers.0"]["local_err_ratio"] > 1
    assert rows["layers.0"]["grad_output_err_ratio"] == 0.0  # what it received agrees
    for name in ("head", "layers.2", "layers.1"):  # before it in backward order
        assert rows[name]["verdict"] == "ok", rows[name]
        assert rows[name]["backward_rank"] < rows["layers.0"]["backward_rank"]
    assert "the layer whose backward differs is layers.0 (Layer)" in message
    assert "Backward: layers.0 (Layer) computes its own gradients differently" in message
    assert rows["<Chain>"]["verdict"] == "local" and rows["<Chain>"]["holds_first"]  # through layers.0
    assert "every submodule call's output agrees" in message  # the forward agrees


def test_a_gradient_cut_in_one_branch_names_that_block():
    torch.manual_seed(0)
    message, rows = _step(Branchy(), {"x": _x()})
    assert _first(rows) == "block", message
    assert rows["block"]["grad_output_err_ratio"] == 0.0 and rows["block"]["grad_input_err_ratio"] > 1
    assert rows["block.b"]["verdict"] == "inherited"  # its own backward is right; its input was cut outside it
    assert rows["head"]["verdict"] == "ok" and rows["pre"]["verdict"] == "inherited"


def test_a_wrong_backward_in_the_middle_is_named_not_the_first_layer_that_inherits_it():
    # Ascend/pytorch#107's shape: the loss agrees, the last layer's gradients agree, the first
    # layer's gradient is 50 % off; the middle layer passes on a gradient × 1.5.
    torch.manual_seed(0)
    message, rows = _step(Chain((None, "input", None)), {"x": _x()})
    assert "every submodule call's output agrees" in message  # loss within tolerance
    assert "grad.layers.0.lin.weight" in message  # the step's own gradient table: the first layer fails
    assert rows["layers.2"]["verdict"] == "ok" and rows["head"]["verdict"] == "ok"
    assert _first(rows) == "layers.1"
    assert rows["layers.1"]["param_grad_err_ratio"] <= 1 < rows["layers.1"]["grad_input_err_ratio"]
    first = rows["layers.0"]
    assert first["verdict"] == "inherited" and first["local_err_ratio"] <= 1 < first["grad_output_err_ratio"]
    assert first["param_grad_rel_l2"] == pytest.approx(0.5, rel=1e-3)  # 50 % off, inherited


def test_a_backward_fault_in_one_llama_decoder_layer_is_named():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))
    model.model.layers[1].mlp.backward_fault = True  # copied with the model to each side
    original = modeling_llama.LlamaMLP.forward

    def forward(self, x):
        y = original(self, x)
        return _ScaledBackward.apply(y) if FAULT["on"] and getattr(self, "backward_fault", False) else y

    ids = torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(1))
    modeling_llama.LlamaMLP.forward = forward
    try:
        message, rows = _step(model, {"input_ids": ids, "labels": ids}, loss_fn=None)
    finally:
        modeling_llama.LlamaMLP.forward = original
    assert _first(rows) == "model.layers.1", message
    assert rows["model.layers.1"]["module_type"] == "LlamaDecoderLayer"
    assert rows["model.norm"]["verdict"] == "ok" and rows["lm_head"]["verdict"] == "ok"
    assert rows["model.layers.0"]["verdict"] == "inherited"
    assert "re-run raised" not in str(rows)


def _captured_call(model: torch.nn.Module, inputs: dict) -> tuple[object, object]:
    """The ``CheckCall`` and record of a failing planted step (kept by a failure hook)."""
    kept = {}

    def keep(case, record, call, result):
        kept.update(call=call, record=record)
        return None
    session = ParitySession(torch.device("cpu"), reference="cpu", failure_hooks=[keep],
                            recipe_policies={"fp32": "allclose"})
    with pytest.raises(ParityError):
        ParityCase(session, "t::keep", patches=_target_fault).train_step("step", model, inputs, loss_fn=_loss,
                                                                         max_grad_norm=None)
    return kept["call"], kept["record"]


def test_a_correct_model_has_no_local_layer_and_the_capture_changes_nothing():
    torch.manual_seed(0)
    # with dropout: each re-run must replay the random stream the call began with
    call, record = _captured_call(Chain((None, "input", None), p=0.3), {"x": _x()})
    clean = ParityCase(_session(), "t::clean")  # no patch set: the target computes what the reference does
    loc = Localization(check="step", reference="a live CPU run")
    start = time.perf_counter()
    backward_table(loc, clean, call, record.tolerance)
    assert time.perf_counter() - start < 10
    assert loc.first_backward is None and loc.backward
    assert {row["verdict"] for row in loc.backward} == {"ok"}
    assert all(row["local_err_ratio"] == 0.0 for row in loc.backward)
    # The capture (forward hooks recording inputs, tensor hooks on outputs) leaves the run bitwise as
    # a plain run without any hook, on the faulty target too (a custom Function in the graph).
    for case in (clean, ParityCase(_session(), "t::faulty", patches=_target_fault)):
        side = _Side(case, call, torch.device("cpu"), patched=True)
        recorder, outs, grads = grad_pass(side, capture=True)
        _, plain_outs, plain_grads = grad_pass(side, capture=False)
        assert recorder.grad_out and outs.keys() == plain_outs.keys() and grads.keys() == plain_grads.keys()
        assert all(torch.equal(outs[k], plain_outs[k]) for k in outs)
        assert all(torch.equal(grads[k], plain_grads[k]) for k in grads)
    # A re-run replays the random stream its call began with: dropout k's re-run passes on what
    # layer k's output received in the pass (the same mask), not a mask drawn from another state.
    calls = {c.key: c for c in recorder.calls}
    for k in range(3):
        drop = calls["drop", k]
        passed_on = call_gradients(side, drop, drop.inputs, drop.rng, recorder.needs[drop.key],
                                   recorder.grad_out[drop.key])
        assert torch.equal(passed_on["grad_input[0][0]"], recorder.grad_out["layers.%d" % k, 0][""])
