"""judge.trajectory: the loss / gradient-norm curve verdict, on curves of real training runs."""
import math

import pytest
import torch

from pytest_npu_parity.judge.trajectory import (DEFAULT_LIMITS, TrajectoryPolicy, default_policy, judge_trajectory,
                                                parting_step, relative_errors)


def train(steps=120, *, weight_scale=1.0, eps=1e-8, clip=1.0, layer0_grad=1.0, threads=None):
    """AdamW (upstream Aurora's settings) on a small MLP regression; the curves judge_trajectory takes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 1))
    x, w = torch.randn(256, 16), torch.randn(16, 1)
    y = 4 * torch.sin(x @ w)  # large enough that clipping at 1.0 acts in the first steps
    with torch.no_grad():
        model[2].weight.mul_(weight_scale)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=eps, weight_decay=0.1)
    layers = {"0": model[0], "2": model[2], "4": model[4]}
    curves = {"loss": [], "grad_norm": [], **{f"layer_grad_norm.{k}": [] for k in layers}}
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        for step in range(steps):
            rows = slice((step * 32) % 256, (step * 32) % 256 + 32)
            loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
            opt.zero_grad()
            loss.backward()
            model[0].weight.grad.mul_(layer0_grad)
            for k, m in layers.items():
                curves[f"layer_grad_norm.{k}"].append(float(torch.linalg.vector_norm(
                    torch.cat([p.grad.reshape(-1) for p in m.parameters()]))))
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip is not None else math.inf)
            curves["loss"].append(loss.item())
            curves["grad_norm"].append(float(norm))
            opt.step()
    finally:
        torch.set_num_threads(previous)
    return {k: torch.tensor(v, dtype=torch.float64) for k, v in curves.items()}


@pytest.fixture(scope="module")
def reference():
    return train()


def test_identical_and_rethreaded_runs_pass(reference):
    assert judge_trajectory(train(), reference, DEFAULT_LIMITS["fp32"]).passed
    result = judge_trajectory(train(threads=1), reference, DEFAULT_LIMITS["fp32"])
    assert result.passed, result.format()
    assert result.loss_parted_at is None


@pytest.mark.parametrize("fault", [dict(weight_scale=1 + 1e-4), dict(eps=1e-7), dict(clip=None)])
def test_planted_training_faults_fail_with_the_parting_step(reference, fault):
    result = judge_trajectory(train(**fault), reference, DEFAULT_LIMITS["fp32"])
    assert not result.passed, result.format()
    # the weight fault moves this MLP's loss by 9.9e-7 on average (just within 1e-6): its grad norms fail it
    assert result.loss_parted_at is not None or result.grad_norm_parted_at is not None
    assert "mean relative loss error" in result.format() and "part at" in result.format()


def test_a_gradient_fault_in_the_first_layer_is_named(reference):
    """Ascend/pytorch#107's shape: one layer's gradient scaled; the module whose norm parts first is it."""
    result = judge_trajectory(train(layer0_grad=1.5), reference, DEFAULT_LIMITS["fp32"])
    assert not result.passed
    assert result.first_parting_layer == ("0", 0)
    assert "first module whose gradient norm parts: 0 at step 0" in result.format()


def test_grad_norms_are_only_reported_without_a_limit(reference):
    curves = dict(reference)
    curves["layer_grad_norm.0"] = curves["layer_grad_norm.0"] * 1.5
    result = judge_trajectory(curves, reference, TrajectoryPolicy(1e-6, None))
    assert result.passed and result.first_parting_layer == ("0", 0)
    assert not judge_trajectory(curves, reference, TrajectoryPolicy(1e-6, 5e-6, layer_limit=5e-6)).passed


def test_parting_step_uses_a_trailing_window():
    errors = torch.zeros(50, dtype=torch.float64)
    errors[20] = 5e-6  # one noisy step: window mean 5e-7
    assert parting_step(errors, 1e-6, window=10) is None
    errors[30:] = 2e-6
    assert parting_step(errors, 1e-6, window=10) == 35  # at 34: (5 * 2e-6) / 10 = 1e-6, not above; at 35: 1.2e-6
    assert parting_step(errors, 1e-6, window=1) == 20


def test_bad_curves_are_named():
    with pytest.raises(ValueError, match="target has no 'loss'"):
        judge_trajectory({}, {"loss": torch.ones(3)}, DEFAULT_LIMITS["fp32"])
    result = judge_trajectory({"loss": torch.ones(3)}, {"loss": torch.ones(3), "grad_norm": torch.ones(4)},
                              DEFAULT_LIMITS["fp32"])
    assert not result.passed and "grad_norm" in result.problems[0]
    result = judge_trajectory({"loss": torch.tensor([1.0, math.nan])}, {"loss": torch.ones(2)}, DEFAULT_LIMITS["fp32"])
    assert not result.passed and "largest inf at step 1" in result.format()  # NaN on one side only


def test_a_step_skipped_on_both_sides_alike_is_no_difference():
    # a loss scaler skips an overflowing step: its gradient norm is inf (or NaN) on both sides
    inf, nan = math.inf, math.nan
    expected = {"loss": torch.ones(4), "grad_norm": torch.tensor([inf, nan, 2.0, 2.0])}
    assert judge_trajectory(dict(expected), expected, DEFAULT_LIMITS["fp32"]).passed
    skipped_once = dict(expected, grad_norm=torch.tensor([inf, nan, inf, 2.0]))
    result = judge_trajectory(skipped_once, expected, DEFAULT_LIMITS["fp32"])
    assert not result.passed and result.grad_norm_parted_at == 2
    with pytest.raises(ValueError, match="limits must be > 0"):
        TrajectoryPolicy(0.0)
    assert default_policy("fp16") is DEFAULT_LIMITS["fp16"] and default_policy("bf16-weights") is DEFAULT_LIMITS["bf16"]
    assert relative_errors(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0])).tolist() == [0.0, 0.0]


def test_a_modules_curve_has_its_own_limit_above_its_legitimate_spread():
    # On another CPU kernel path a small module's gradient-norm curve moved by 1.1e-5 on average (the
    # module docstring): within fp32's layer limit, while the global curves stay exact. 2e-3 fails.
    steps = torch.linspace(1.0, 2.0, 50, dtype=torch.float64)
    expected = {"loss": steps, "grad_norm": steps, "layer_grad_norm.text": steps / 100}
    legit = dict(expected, **{"layer_grad_norm.text": steps / 100 * (1 + 1.1e-5)})
    assert judge_trajectory(legit, expected, DEFAULT_LIMITS["fp32"]).passed
    faulty = dict(expected, **{"layer_grad_norm.text": steps / 100 * (1 + 2e-3)})
    result = judge_trajectory(faulty, expected, DEFAULT_LIMITS["fp32"])
    assert not result.passed and result.first_parting_layer == ("text", 0)
    assert "layer_grad_norm.text: mean relative error 0.002 > 0.001" in result.format()


def test_a_policy_without_a_layer_limit_reports_modules_without_failing():
    steps = torch.linspace(1.0, 2.0, 50, dtype=torch.float64)
    expected = {"loss": steps, "layer_grad_norm.a": steps}
    result = judge_trajectory(dict(expected, **{"layer_grad_norm.a": steps * 1.5}), expected,
                              TrajectoryPolicy(1e-6, 5e-6))
    assert result.passed and result.first_parting_layer == ("a", 0)
    with pytest.raises(ValueError, match="layer_limit"):
        TrajectoryPolicy(1e-6, layer_limit=0.0)


def test_loss_curves_that_cannot_be_compared_say_so_instead_of_a_nan_error():
    result = judge_trajectory({"loss": torch.ones(15)}, {"loss": torch.ones(20)}, DEFAULT_LIMITS["fp32"])
    text = result.format()
    assert not result.passed and "the loss curves could not be compared" in text and "nan" not in text
    assert "loss: curves of 15 and 20 steps cannot be compared step by step" in text
