"""What real models return: dataclasses and named tuples (leaves named by field), string and integer
fields (compared exactly), recorded in a baseline and compared against it."""
from __future__ import annotations

import collections
import contextlib
import dataclasses

import pytest
import torch

from pytest_npu_parity.baselines import SuiteStores
from pytest_npu_parity.compare import ParityError
from pytest_npu_parity.runner import ParityCase, ParitySession

CPU = torch.device("cpu")
TEST_ID = "parity_suites/demo/test_out.py::t"
Stats = collections.namedtuple("Stats", "mean std")


@dataclasses.dataclass
class Forecast:
    point: torch.Tensor
    stats: Stats
    horizon: int
    unit: str


class Forecaster(torch.nn.Module):
    shift = 0.0

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.proj = torch.nn.Linear(16, 8)
        with torch.no_grad():
            self.proj.weight.copy_(torch.randn(8, 16, generator=g) / 4)
            self.proj.bias.zero_()

    def forward(self, x: torch.Tensor) -> Forecast:
        y = self.proj(x) + Forecaster.shift
        return Forecast(y, Stats(y.mean(-1), y.std(-1)), horizon=8, unit="ppm")


@contextlib.contextmanager
def shifted(device: torch.device):
    Forecaster.shift = 1e-3
    try:
        yield
    finally:
        Forecaster.shift = 0.0


X = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))


def test_a_dataclass_output_is_compared_by_field_name_and_fails_a_fault():
    record = ParityCase(ParitySession(CPU, reference="cpu"), TEST_ID, "fp32").check("fc", Forecaster(), X)
    assert [leaf.path for leaf in record.result.leaves] == ["point", "stats.mean", "stats.std", "horizon", "unit"]
    with pytest.raises(ParityError, match="stats.mean"):
        ParityCase(ParitySession(CPU, reference="cpu"), TEST_ID, "fp32", patches=shifted).check("fc", Forecaster(), X)


def test_a_dataclass_output_is_recorded_and_compared_against_its_baseline(tmp_path):
    store = SuiteStores(tmp_path)
    recording = ParityCase(ParitySession(CPU, update_baselines=True, store=store), TEST_ID, "fp32")
    recording.check("fc", Forecaster(), X)
    assert recording.finish() == "created"
    assert {"unit", "horizon", "stats.std"} <= set(store.load(TEST_ID).checks["fc"].tensors)
    record = ParityCase(ParitySession(CPU, store=store), TEST_ID, "fp32").check("fc", Forecaster(), X)
    assert record.status == "pass" and record.reference == "baseline"


def test_a_changed_string_field_fails_naming_it():
    class Renamed(Forecaster):
        def forward(self, x):
            out = super().forward(x)
            return dataclasses.replace(out, unit="ppb") if Forecaster.shift else out

    with pytest.raises(ParityError, match="unit"):
        ParityCase(ParitySession(CPU, reference="cpu"), TEST_ID, "fp32", patches=shifted).check(
            "fc", Renamed(), X, rtol=1.0, atol=1.0)


def test_without_drops_the_named_leaves_and_leaves_the_rest_alone():
    from pytest_npu_parity.leaves import without

    leaves = {"loss": torch.tensor(1.0), "param.w": torch.ones(2), "grad.w": None}
    kept = without(leaves, {"param.w", "absent"})
    assert list(kept) == ["loss", "grad.w"] and kept["loss"] is leaves["loss"]
    assert "param.w" in leaves  # a new dict: the side's own leaves are not changed
    assert without(None, {"loss"}) is None
