"""The counterfactual names the patch of a patch set that a failure comes from.

A patch set whose context returns an object with ``applied`` (names) and ``suspended(*names)`` can turn
single patches off; the attribution then bisects the set (``attribution.bisect_patches``) when turning the
whole set off removes the error or the target cannot run without it. Planted: a patch set of four
patches, one of which scales a layer's output by (1 + 1e-3); another one the target cannot run without.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from pytest_npu_parity.compare import ParityError
from pytest_npu_parity.localize import Localizer
from pytest_npu_parity.runner import ParityCase, ParitySession
from pytest_npu_parity.runtime.side import patches_suspended


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x):
        if STATE.required_missing:
            raise RuntimeError("op not supported on this device (the 'required' patch is off)")
        h = torch.tanh(self.a(x))
        if STATE.scaled:
            h = h * (1 + 1e-3)
        return self.b(h)


class _State:
    scaled = False
    required_missing = False


STATE = _State()


class PatchSet:
    """Four named patches; ``suspended`` turns some off inside a block."""

    NAMES = ["required", "harmless_1", "scale_fault", "harmless_2"]

    def __init__(self, faulty: bool = True, required: bool = False):
        self.applied = list(self.NAMES)
        self.faulty, self.required = faulty, required
        self.off: set[str] = set()
        self._sync()

    def _sync(self):
        STATE.scaled = self.faulty and "scale_fault" not in self.off
        STATE.required_missing = self.required and "required" in self.off

    @contextlib.contextmanager
    def suspended(self, *names):
        unknown = set(names) - set(self.applied)
        if unknown:
            raise KeyError(f"not applied: {sorted(unknown)}")
        saved = set(self.off)
        self.off |= set(names)
        self._sync()
        try:
            yield self
        finally:
            self.off = saved
            self._sync()


def factory(required: bool = False):
    @contextlib.contextmanager
    def patches(device):
        patch_set = PatchSet(required=required)
        try:
            yield patch_set
        finally:
            STATE.scaled = STATE.required_missing = False
    return patches


def _net_and_input():
    torch.manual_seed(0)
    return Net().eval(), torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


def _fail(case, *args):
    with pytest.raises(ParityError) as info:
        case.check(*args)
    return str(info.value), case.records[-1]


def _session():
    return ParitySession(torch.device("cpu"), reference="cpu", failure_hooks=[Localizer(None)])


def _singles(record):
    rows = [r for r in record.whatfix.counterfactual if r["kind"] == "counterfactual" and r["patches"]]
    return {r["patches"][0]: r for r in rows if len(r["patches"]) == 1}


@pytest.mark.parametrize("required", [False, True], ids=["plain", "with a patch the target needs"])
def test_the_faulty_patch_is_named_root_cause_and_the_others_are_cleared(required):
    model, x = _net_and_input()
    case = ParityCase(_session(), "t::patches", patches=factory(required))
    message, record = _fail(case, "m", model, x)
    singles = _singles(record)
    assert singles["scale_fault"]["verdict"] == "root cause" and singles["scale_fault"]["passed"], message
    assert "patch scale_fault turned off, the rest of the patch set in force" in message
    assert singles["harmless_2"]["verdict"] == "no effect", message
    whole = next(r for r in record.whatfix.counterfactual if r.get("suspect_kind") == "patch set")
    assert whole["verdict"] == "root cause", message
    runs = [r for r in record.whatfix.counterfactual if r.get("suspect_kind") in ("patch set", "patches")]
    if required:  # the half holding the needed patch cannot run: it is split too, and its patches named
        assert singles["required"]["verdict"] == "not run", message
        assert "the 'required' patch is off" in singles["required"]["problem"], message
        assert singles["harmless_1"]["verdict"] == "no effect", message
        assert len(runs) == 7, message  # the whole set, two halves, two patches in each
    else:  # the whole set, two halves, then the faulty half's two patches; the harmless half is not split
        assert len(runs) == 5 and "harmless_1" not in singles, message


def test_a_patch_set_that_cannot_suspend_single_patches_is_attributed_as_a_whole():
    model, x = _net_and_input()

    @contextlib.contextmanager
    def opaque(device):  # returns nothing: the patches cannot be named nor turned off one by one
        STATE.scaled = True
        try:
            yield
        finally:
            STATE.scaled = False

    message, record = _fail(ParityCase(_session(), "t::opaque", patches=opaque), "m", model, x)
    kinds = [r.get("suspect_kind") for r in record.whatfix.counterfactual]
    assert kinds.count("patch set") == 1 and "patches" not in kinds, message


def test_a_patched_run_inside_patches_suspended_needs_a_patch_set_that_can_suspend():
    @contextlib.contextmanager
    def opaque(device):
        yield None

    model, x = _net_and_input()
    case = ParityCase(ParitySession(torch.device("cpu"), reference="cpu"), "t::suspend", patches=opaque)
    with patches_suspended(["a"]), pytest.raises(TypeError, match=r"opaque.*cannot turn single patches off"):
        case.check("m", model, x)
