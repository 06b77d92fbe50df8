"""A module that changes state of its own in an eval-mode forward — a call counter in a buffer, a
buffer it replaces, a ``torch.Generator`` attribute or argument it draws from: both sides start from
the caller's state (the target no longer sees what the reference changed), the caller's module and
generator are left as they were, and a planted fault still fails."""
from __future__ import annotations

import pytest
import torch

from pytest_npu_parity.compare import ParityError
from pytest_npu_parity.runner import ParityCase, ParitySession
from switches import switched

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
    return switched(cls, "fault", fault)


def case(recipe: str, patches=None) -> ParityCase:
    return ParityCase(ParitySession(CPU, reference="cpu"), TEST_ID, recipe, patches=patches)


def x() -> torch.Tensor:
    return torch.randn(3, 8, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("recipe", ["fp32", "bf16"])
@pytest.mark.parametrize("replace", [False, True], ids=["in_place", "replaced"])
def test_an_eval_mode_call_counter_passes_and_is_left_as_it_was(recipe, replace, monkeypatch):
    monkeypatch.setattr(Counter, "replace", replace)
    model = Counter().eval()
    record = case(recipe).check("counter", model, x())
    assert record.status == "pass"
    assert float(model.calls) == 0.0  # the caller's module is as it was
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


class Total(torch.nn.Module):
    """Adds its input to a running total kept in a buffer and returns the buffer itself."""

    fault = 1.0  # the step; the target's patch set changes it

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.randn(3, 8, generator=torch.Generator().manual_seed(0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.total.add_(x * Total.fault)
        return self.total


class Cached(torch.nn.Module):
    """Fills a cache on its first call (a None buffer, or a plain attribute) and adds it to the output;
    the target's patch set fills it with an offset."""

    offset = 0.0

    def __init__(self, as_buffer: bool) -> None:
        super().__init__()
        self.as_buffer = as_buffer
        if as_buffer:
            self.register_buffer("table", None)
        else:
            self.table = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            self.table = torch.linspace(0, 1, x.shape[-1]) + Cached.offset
        return x * 2 + self.table


@pytest.mark.parametrize("recipe", ["fp32", "bf16"])
def test_an_output_that_is_a_buffer_the_forward_changed_is_judged_on_the_runs_values(recipe):
    # the buffer was put back before the output was taken: both sides showed the old total, a false pass
    model = Total().eval()
    assert case(recipe).check("total", model, x()).status == "pass"
    with pytest.raises(ParityError):
        case(recipe, patches=target(Total, 5.0)).check("total", model, x())
    assert torch.equal(model.total, Total().total)


@pytest.mark.parametrize("as_buffer", [True, False], ids=["none_buffer", "attribute"])
def test_a_cache_filled_on_first_use_is_filled_by_each_side(as_buffer):
    # the target reused the cache the reference had filled: a fault in the target's fill passed
    model = Cached(as_buffer).eval()
    assert case("fp32").check("cached", model, x()).status == "pass"
    with pytest.raises(ParityError):
        case("fp32", patches=switched(Cached, "offset", 1.0)).check("cached", model, x())
    assert model.table is None


class DataCounter(torch.nn.Module):
    """Counts its calls through ``.data`` (no version counter sees it) and in a plain int attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)
        _weights(self.lin)
        self.register_buffer("calls", torch.zeros(()))
        self.n = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.data += 1
        self.n += 1
        return self.lin(x) * self.calls + self.n


def test_state_changed_through_data_or_a_plain_attribute_is_put_back():
    model = DataCounter().eval()
    assert case("fp32").check("counter", model, x()).status == "pass"
    assert float(model.calls) == 0.0 and model.n == 0


def test_a_module_called_through_a_closure_is_put_back_too():
    model = Counter().eval()
    assert case("fp32").check("counter", lambda inp: model(inp) * 2, x()).status == "pass"
    assert float(model.calls) == 0.0
