"""judge.forecast: per-window MSE, MAE and CRPS of sampled forecasts, and the verdict of two sides' metrics."""
import math

import pytest
import torch

from pytest_npu_parity.judge.forecast import forecast_metrics, judge_forecast


def _normal_crps(mu, sigma, y):
    """Closed-form CRPS of N(mu, sigma^2) at y (Gneiting & Raftery 2007, eq. 5)."""
    z = (y - mu) / sigma
    pdf = math.exp(-z * z / 2) / math.sqrt(2 * math.pi)
    cdf = 0.5 * (1 + math.erf(z / math.sqrt(2)))
    return sigma * (z * (2 * cdf - 1) + 2 * pdf - 1 / math.sqrt(math.pi))


def test_crps_of_normal_samples_matches_the_closed_form():
    g = torch.Generator().manual_seed(0)
    samples = 0.5 + 2.0 * torch.randn(1, 4000, 3, generator=g, dtype=torch.float64)
    target = torch.tensor([[0.5, 1.5, -3.0]], dtype=torch.float64)
    crps = forecast_metrics(samples, target)["crps"]
    expected = sum(_normal_crps(0.5, 2.0, y) for y in (0.5, 1.5, -3.0)) / 3
    assert float(crps[0]) == pytest.approx(expected, rel=0.03)


def test_a_point_forecast_has_crps_equal_to_its_absolute_error_and_mse_mae_as_defined():
    samples = torch.tensor([[[1.0, 2.0]] * 5])  # [W=1, S=5, H=2], all samples equal
    target = torch.tensor([[0.0, 4.0]])
    m = forecast_metrics(samples, target)
    assert float(m["crps"][0]) == pytest.approx(1.5) and float(m["mae"][0]) == pytest.approx(1.5)
    assert float(m["mse"][0]) == pytest.approx((1 + 4) / 2)


def test_shapes_are_checked():
    with pytest.raises(ValueError, match=r"\[W, S, H\]"):
        forecast_metrics(torch.zeros(2, 3), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="2 samples"):
        forecast_metrics(torch.zeros(2, 1, 3), torch.zeros(2, 3))


def test_a_worse_forecast_fails_and_names_the_window_that_differs_most():
    expected = {"forecast.mse": torch.tensor([1.0, 1.0, 1.0]), "forecast.crps": torch.tensor([0.5, 0.5, 0.5])}
    actual = {"forecast.mse": torch.tensor([1.0, 1.3, 1.0]), "forecast.crps": torch.tensor([0.5, 0.6, 0.5001])}
    result = judge_forecast(actual, expected, 1e-2, labels=["a", "b", "c"])
    assert not result.passed and [m.name for m in result.metrics if not m.passed] == ["mse", "crps"]
    assert result.windows[0][0] == "b" and result.windows[1][0] == "c"
    assert "windows whose CRPS differs most: b" in result.format()
    assert judge_forecast(expected, expected, 1e-2).passed


def test_a_metric_missing_on_the_target_is_a_problem():
    result = judge_forecast({}, {"forecast.mae": torch.ones(2)}, 1e-2)
    assert not result.passed and "missing on the target" in result.problems[0]
