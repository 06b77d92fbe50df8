"""The report plots each training-trajectory check: both curves and their relative difference, in the page and as PNG."""
import contextlib

import pytest
import torch

from pytest_npu_parity.judge.allclose import ParityError
from pytest_npu_parity.report.write import write_report
from pytest_npu_parity.runner import ParityCase, ParitySession
from pytest_npu_parity.runtime.trajectory import TrajectoryLoop

LOOP = TrajectoryLoop(steps=30, learning_rate=1e-3, loss_fn=torch.nn.functional.mse_loss)


def _rows(scale):
    """The report rows of one trajectory check whose target scales the first weight by ``scale``."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    batches = [(x[i:i + 16], x[i:i + 16].sum(1, keepdim=True)) for i in range(0, 64, 16)]

    @contextlib.contextmanager
    def scaled(device):
        saved = net[0].weight.detach().clone()
        with torch.no_grad():
            net[0].weight.mul_(scale)
        try:
            yield
        finally:
            with torch.no_grad():
                net[0].weight.copy_(saved)

    case = ParityCase(ParitySession(torch.device("cpu"), reference="cpu"), "tests/t.py::t", "fp32", patches=scaled)
    with pytest.raises(ParityError) if scale != 1.0 else contextlib.nullcontext():
        case.trajectory("curves", net, batches, loop=LOOP)
    return case.records[0].rows()


def test_a_failing_trajectory_is_plotted_in_the_page_and_as_png(tmp_path):
    rows = _rows(1.01)
    paths = write_report(rows, {"run_id": "r"}, tmp_path)
    png = paths["trajectory0"].read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    page = paths["html"].read_text()
    assert "<h2>Training trajectories</h2>" in page and "curves [fp32] t — fail" in page
    assert page.count("data:image/png;base64,") >= 1 + sum(1 for k in paths if k.startswith("plot"))


def test_a_report_without_trajectories_has_no_such_section(tmp_path):
    rows = [dict(r, trajectory_series=None) for r in _rows(1.0)]
    paths = write_report(rows, {"run_id": "r"}, tmp_path)
    assert not any(k.startswith("trajectory") for k in paths)
    assert "Training trajectories" not in paths["html"].read_text()
