"""A module that changes state of its own in an eval-mode forward — a call counter in a buffer, a
buffer it replaces, a ``torch.Generator`` attribute or argument it draws from: both sides start from
the caller's state (the target no longer sees what the reference changed), the caller's module and
generator are left as they were, and a planted fault still fails."""
from __future__ import annotations

import contextlib

import pytest
import torch

from pytest_npu_parity.compare import ParityError
from pytest_npu_parity.runner import ParityCase, ParitySession

CPU = torch.device("cpu")
TEST_ID = "parity_suites/demo/test_m.py::t"


def _weights(lin: torch.nn.Linear) -> None:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(lin.weight.shape, generator=g))
        lin.bias.zero_()


class Counter(torch.nn.Module):
    """Counts its calls in a buffer (in place, or by replacing the buffer) and adds the count to its output."""

    replace = False
    fault = 0.0

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)
        _weights(self.lin)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if Counter.replace:
            self.calls = self.calls + 1
        else:
            self.calls += 1
        return self.lin(x) + self.calls + Counter.fault


class Noisy(torch.nn.Module):
    """Adds noise drawn from a generator of its own (an attribute), or from one passed in."""

    fault = 1.0

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)
        _weights(self.lin)
        self.gen = torch.Generator().manual_seed(7)

    def forward(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        y = self.lin(x)
        return y + Noisy.fault * torch.randn(y.shape, generator=generator or self.gen)


def target(cls: type, fault: float):
    @contextlib.contextmanager
    def patches(device: torch.device):
        before = cls.fault
        cls.fault = fault
        try:
            yield
        finally:
            cls.fault = before
    return patches


def case(recipe: str, patches=None) -> ParityCase:
    return ParityCase(ParitySession(CPU, reference="cpu"), TEST_ID, recipe, patches=patches)


def x() -> torch.Tensor:
    return torch.randn(3, 8, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("recipe", ["fp32", "bf16"])
@pytest.mark.parametrize("replace", [False, True], ids=["in_place", "replaced"])
def test_an_eval_mode_call_counter_passes_and_is_left_as_it_was(recipe, replace, monkeypatch):
    monkeypatch.setattr(Counter, "replace", replace)
    model = Counter().eval()
    calls = model.calls
    record = case(recipe).check("counter", model, x())
    assert record.status == "pass"
    assert model.calls is calls and float(model.calls) == 0.0  # the caller's module is unchanged
    again = case(recipe).check("counter", model, x())  # and the next check starts from the same state
    assert again.status == "pass"
    if recipe == "fp32":  # the same computation on both sides, bitwise
        assert record.result.leaves[0].max_abs == 0.0


@pytest.mark.parametrize("recipe", ["fp32", "bf16"])
def test_a_fault_in_the_counting_module_still_fails(recipe):
    with pytest.raises(ParityError):
        case(recipe, patches=target(Counter, 0.5)).check("counter", Counter().eval(), x())


@pytest.mark.parametrize("recipe", ["fp32", "bf16"])
def test_a_generator_attribute_gives_both_sides_the_same_draws_and_does_not_advance(recipe):
    model = Noisy().eval()
    state = model.gen.get_state()
    record = case(recipe).check("noisy", model, x())
    assert record.status == "pass"
    assert torch.equal(model.gen.get_state(), state)
    if recipe == "fp32":
        assert record.result.leaves[0].max_abs == 0.0


@pytest.mark.parametrize("recipe", ["fp32", "bf16"])
def test_a_generator_argument_is_fingerprinted_copied_per_side_and_does_not_advance(recipe):
    gen = torch.Generator().manual_seed(11)
    state = gen.get_state()
    record = case(recipe).check("noisy", Noisy().eval(), x(), generator=gen)
    assert record.status == "pass"
    assert torch.equal(gen.get_state(), state)


@pytest.mark.parametrize("recipe", ["fp32", "bf16"])
@pytest.mark.parametrize("argument", [False, True], ids=["attribute", "argument"])
def test_a_fault_in_the_noise_still_fails(recipe, argument):
    kwargs = {"generator": torch.Generator().manual_seed(11)} if argument else {}
    with pytest.raises(ParityError):
        case(recipe, patches=target(Noisy, 1.05)).check("noisy", Noisy().eval(), x(), **kwargs)
