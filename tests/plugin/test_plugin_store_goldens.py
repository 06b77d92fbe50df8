"""``--parity-store-goldens`` through pytest: a compare run adds the goldens it computes live to baselines
recorded without them (and only to those), keeps every reference leaf, works under pytest-xdist, and
refuses to be combined with a record run or a live CPU reference."""
from __future__ import annotations

import pytest
import torch

from pytest_npu_parity.baselines import SuiteStores, _read
from pytest_npu_parity.checks import stored_golden as S

TEST_FILE = """
import torch
from torch import nn


def _module():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).eval()


def test_a(parity):
    torch.manual_seed(1)
    parity.check("mlp", _module(), torch.randn(4, 16))


def test_b(parity):
    torch.manual_seed(2)
    parity.check("mlp", _module(), torch.randn(4, 16))
"""


def _project(pytester: pytest.Pytester) -> SuiteStores:
    """Record both tests under fp32 and bf16, then strip the goldens (as recorded before they were stored)."""
    pytester.makeini("""
        [pytest]
        parity_dtypes = fp32,bf16
    """)
    pytester.makepyfile(test_store=TEST_FILE)
    result = pytester.runpytest("--update-baselines", "test_store.py")
    assert result.ret == 0, result.stdout.str()
    store = SuiteStores(pytester.path / "baselines")
    for test_id in _ids(store):
        baseline = store.load(test_id)
        for entry in baseline.checks.values():
            entry.meta.pop(S.META_KEY, None)
            entry.extras = {k: v for k, v in entry.extras.items() if not k.startswith(S.GOLDEN_PREFIX)}
        store.write(test_id, baseline.checks, baseline.provenance)
    return store


def _ids(store: SuiteStores) -> list[str]:
    return sorted(_read(path).test_id for path in store.baseline_files())


def _references(store: SuiteStores) -> dict:
    return {(test_id, name, leaf): bytes(t.contiguous().view(-1).view(torch.uint8).numpy())
            for test_id in _ids(store) for name, entry in store.load(test_id).checks.items()
            for leaf, t in entry.tensors.items()}


def _goldens(store: SuiteStores) -> dict[str, bool]:
    return {test_id: S.META_KEY in store.load(test_id).checks["mlp"].meta for test_id in _ids(store)}


def test_store_goldens_adds_them_to_the_golden_judged_checks_only_keeping_the_references(
        pytester: pytest.Pytester) -> None:
    store = _project(pytester)
    before = _references(store)
    assert set(_goldens(store).values()) == {False}
    result = pytester.runpytest_subprocess("--npu-parity", "--parity-store-goldens", "-n", "2", "test_store.py")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["*2 checks computed the golden live, and it is now stored in their baselines*",
                                 "baselines: 2 changed (2 files under *"])
    # bf16 eval checks are judged by the golden floor, fp32 eval checks by allclose (checks.settings)
    assert _goldens(store) == {"test_store.py::test_a[bf16]": True, "test_store.py::test_a[fp32]": False,
                               "test_store.py::test_b[bf16]": True, "test_store.py::test_b[fp32]": False}
    assert _references(store) == before
    result = pytester.runpytest_subprocess("--npu-parity", "test_store.py")  # now: no golden run, no note
    result.assert_outcomes(passed=4)
    assert "computed the golden live" not in result.stdout.str()


@pytest.mark.parametrize("args, message", [
    (["--update-baselines"], "--update-baselines stores them already"),
    (["--npu-parity", "--parity-reference", "cpu"], "which --parity-reference=cpu does not use")])
def test_store_goldens_refuses_a_record_run_and_a_live_reference(pytester: pytest.Pytester, args, message) -> None:
    pytester.makepyfile(test_store=TEST_FILE)
    result = pytester.runpytest("--parity-store-goldens", *args, "test_store.py")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert message in result.stderr.str()
