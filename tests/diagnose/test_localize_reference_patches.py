"""The diagnosis's reference-side re-runs enter the case's reference patches, as the check's own do.

A computation that cannot run at all without some patches (upstream Aurora under bf16 weights: its FFT
raises on bfloat16) is checked with ``parity_reference_patches`` on the reference side. The localization
re-runs that side too; without them it raised and the failure got no diagnosis. Planted: a model that
raises unless a "needed" patch is in force (both sides have it: the reference through its reference
patches, the target through its patch set), and a scaled weight in one block on the target.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from pytest_npu_parity.compare import ParityError
from pytest_npu_parity.localize import Localizer
from pytest_npu_parity.runner import ParityCase, ParitySession

NEEDED = {"on": False}


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        if not NEEDED["on"]:
            raise RuntimeError("unsupported without the needed patch")
        return torch.tanh(self.lin(x))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block() for _ in range(3)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@contextlib.contextmanager
def _needed(device):
    saved, NEEDED["on"] = NEEDED["on"], True
    try:
        yield
    finally:
        NEEDED["on"] = saved


def test_the_localization_runs_its_reference_side_under_the_reference_patches():
    torch.manual_seed(0)
    model, x = Net().eval(), torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    weight = model.blocks[1].lin.weight

    @contextlib.contextmanager
    def target(device):
        with _needed(device), torch.no_grad():
            saved = weight.clone()
            weight.mul_(1 + 1e-3)
            try:
                yield
            finally:
                weight.copy_(saved)

    session = ParitySession(torch.device("cpu"), reference="cpu", failure_hooks=[Localizer(None)])
    case = ParityCase(session, "t::refpatches", patches=target, reference_patches=_needed)
    with pytest.raises(ParityError) as info:
        case.check("net", model, x)
    message = str(info.value)
    assert "could not run" not in message and "unsupported without the needed patch" not in message, message
    assert "First divergence: blocks.1.lin (Linear)" in message, message
    rows = {r["suspect"]: r for r in case.records[-1].whatfix.counterfactual if r["kind"] == "counterfactual"}
    assert rows["blocks.1.lin (Linear)"]["verdict"] == "root cause", message


def test_the_counterfactual_computes_its_float64_references_under_the_reference_patches():
    torch.manual_seed(0)
    model, x = Net().eval(), torch.randn(4, 8, generator=torch.Generator().manual_seed(1))

    @contextlib.contextmanager
    def target(device):  # block 1's own code is wrong on the target: its suspect is the block itself
        with _needed(device):
            forward = model.blocks[1].forward
            model.blocks[1].forward = lambda x: forward(x) * (1 + 1e-3)
            try:
                yield
            finally:
                del model.blocks[1].forward

    session = ParitySession(torch.device("cpu"), reference="cpu", failure_hooks=[Localizer(None)])
    case = ParityCase(session, "t::refpatches-cf", patches=target, reference_patches=_needed)
    with pytest.raises(ParityError) as info:
        case.check("net", model, x)
    message = str(info.value)
    rows = {r["suspect"]: r for r in case.records[-1].whatfix.counterfactual if r["kind"] == "counterfactual"}
    assert rows["blocks.1 (Block)"]["verdict"] == "root cause", message
