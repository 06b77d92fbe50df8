"""A counterfactual suspect whose float64 CPU reference cannot run is "not run"; the diagnosis stands.

Upstream code that hard-codes the default dtype (Aurora's ``resample`` builds its identity in float32)
cannot run as a float64 copy. Before, the exception ended the whole diagnosis ("Localizer could not
run"); now that suspect's row says why it was not run and the other suspects are attributed.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from pytest_npu_parity.compare import ParityError
from pytest_npu_parity.localize import Localizer
from pytest_npu_parity.runner import ParityCase, ParitySession


def _fail(case, *args):
    with pytest.raises(ParityError) as info:
        case.check(*args)
    return str(info.value), case.records[-1]


def _session():
    return ParitySession(torch.device("cpu"), reference="cpu", failure_hooks=[Localizer(None)])


class Float32Only(torch.nn.Module):
    """Builds a float32 constant: its float64 copy cannot run (a dtype mismatch), as upstream code that
    hard-codes the default dtype cannot."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    scale = 1.0  # the target's port scales the constant (its own code, outside its submodule)

    def forward(self, x):
        return self.lin(x) @ (torch.eye(8) * self.scale)


def test_a_suspect_whose_float64_reference_cannot_run_is_not_run_and_the_rest_stands():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Float32Only()).eval()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))

    @contextlib.contextmanager
    def scaled(device):
        model[1].scale = 1 + 1e-3
        try:
            yield
        finally:
            model[1].scale = 1.0

    message, record = _fail(ParityCase(_session(), "t::float32only", patches=scaled), "m", model, x)
    assert "What makes it pass" in message and "Localizer could not run" not in message, message
    rows = {r["suspect"]: r for r in record.whatfix.counterfactual if r["kind"] == "counterfactual"}
    assert rows["1 (Float32Only)"]["verdict"] == "not run", message
    assert "its float64 CPU reference raised RuntimeError" in rows["1 (Float32Only)"]["problem"]
    assert rows["the patch set"]["verdict"] == "root cause", message
