"""A check whose reference output lies within atol of zero warns by default (no --parity-selfcheck):
its tolerance cannot see a change of the output's own size."""
from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

from pytest_npu_parity.policy import Tolerance
from pytest_npu_parity.runner import ParityCase, ParitySession
from pytest_npu_parity.selfcheck import ParityVacuityWarning, below_tolerance

CPU = torch.device("cpu")


def tiny_linear(scale: float) -> torch.nn.Linear:
    g = torch.Generator().manual_seed(0)
    m = torch.nn.Linear(8, 8)
    with torch.no_grad():
        m.weight.copy_(torch.randn(8, 8, generator=g) * scale)
        m.bias.zero_()
    return m


X = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


@contextlib.contextmanager
def zero_output(device: torch.device):
    """A patch set under which every Linear returns zeros: a fault as large as the output."""
    forward = torch.nn.Linear.forward
    torch.nn.Linear.forward = lambda self, x: torch.zeros(*x.shape[:-1], self.out_features)
    try:
        yield
    finally:
        torch.nn.Linear.forward = forward


def run(model, patches=None, **kwargs):
    case = ParityCase(ParitySession(CPU, reference="cpu"), "tests/t.py::t", "fp32", patches=patches)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        record = case.check("out", model, X, **kwargs)
    return record, [w for w in caught if issubclass(w.category, ParityVacuityWarning)]


def test_an_output_below_atol_warns_and_a_zeroed_target_would_indeed_pass():
    record, caught = run(tiny_linear(1e-7))
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "'out' is nearly vacuous" in message and "within atol of zero" in message and "vacuous_ok" in message
    assert "within atol of zero" in record.extra["policy_note"]
    zeroed, _ = run(tiny_linear(1e-7), patches=zero_output)  # why it warns: a target returning zeros passes
    assert zeroed.status == "pass"


def test_an_ordinary_output_does_not_warn_and_a_zeroed_target_fails():
    record, caught = run(tiny_linear(1.0))
    assert caught == [] and "atol" not in (record.extra.get("policy_note") or "")
    with pytest.raises(Exception, match="Mismatched elements"):
        run(tiny_linear(1.0), patches=zero_output)


def test_vacuous_ok_silences_the_warning():
    _, caught = run(tiny_linear(1e-7), vacuous_ok="a damped head: covered by the layer check")
    assert caught == []


def test_below_tolerance_needs_every_judged_leaf_small():
    tol = Tolerance(1e-5, 1e-5)
    small, big = torch.full((3,), 1e-9) * torch.arange(3), torch.arange(3.0)
    assert below_tolerance({"a": small}, tol)
    assert below_tolerance({"a": small, "b": big}, tol) is None
    assert below_tolerance({"a": small, "loss": torch.tensor(1e-9)}, tol)  # a lone scalar is not judged
    assert below_tolerance({"a": torch.tensor([1e-9, float("nan")])}, tol) is None
    assert below_tolerance({"i": torch.arange(3)}, tol) is None  # integers are compared exactly
