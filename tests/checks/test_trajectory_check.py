"""ParityCase.trajectory: N training steps per side, judged by their loss and gradient-norm curves.

A small MLP regression trained with AdamW; faults are planted on the target through the case's patch set,
as a port's runtime patches would change it: a weight off by 1e-4, AdamW's weight decay 0.01 for 0.1,
clipping gone (AdamW's eps ×10 is invisible on this model's large gradients; tests/aurora plants it there).
"""
import contextlib

import pytest
import torch

from pytest_npu_parity.judge.allclose import ParityError
from pytest_npu_parity.judge.trajectory import TrajectoryPolicy
from pytest_npu_parity.runner import ParityCase, ParitySession
from pytest_npu_parity.runtime import training_faults
from pytest_npu_parity.runtime.trajectory import TrajectoryLoop
from pytest_npu_parity.store.suites import SuiteStores

CPU = torch.device("cpu")
TEST_ID = "tests/checks/test_trajectory_check.py::t"
LOOP = TrajectoryLoop(steps=120, learning_rate=1e-3, loss_fn=torch.nn.functional.mse_loss)


def batches():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=g)
    y = 4 * torch.sin(x @ torch.randn(16, 1, generator=g))  # large enough that clipping at 1.0 acts
    return [(x[i:i + 32], y[i:i + 32]) for i in range(0, 256, 32)]


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                               torch.nn.Linear(64, 1))


def target(weight_scale=1.0, eps_scale=1.0, weight_decay=None, clip=True):
    """A target patch set: the second Linear's weight scaled, AdamW's eps scaled or its weight decay
    replaced (a fused optimizer with other defaults), or clipping removed."""
    @contextlib.contextmanager
    def patches(device):
        with contextlib.ExitStack() as stack:
            if weight_scale != 1.0:
                stack.enter_context(_scaled_weight(weight_scale))
            if eps_scale != 1.0 or weight_decay is not None:
                adamw = torch.optim.AdamW
                torch.optim.AdamW = lambda params, **kw: adamw(params, **dict(
                    kw, eps=kw["eps"] * eps_scale, weight_decay=kw["weight_decay"] if weight_decay is None
                    else weight_decay))
                stack.callback(setattr, torch.optim, "AdamW", adamw)
            if not clip:
                stack.enter_context(training_faults.no_clipping())
            yield
    return patches


MODEL = net()


@contextlib.contextmanager
def _scaled_weight(scale):
    # the module each side copies when its run starts (runtime.training: copied after the patch set is entered)
    with torch.no_grad():
        saved = MODEL[2].weight.clone()
        MODEL[2].weight.mul_(scale)
    try:
        yield
    finally:
        with torch.no_grad():
            MODEL[2].weight.copy_(saved)


def live(recipe="fp32", patches=None):
    return ParityCase(ParitySession(CPU, reference="cpu"), TEST_ID, recipe, patches=patches)


def test_a_clean_trajectory_passes_with_one_row_per_curve():
    record = live().trajectory("curve", MODEL, batches(), loop=LOOP)
    assert record.status == "pass" and record.policy == "trajectory"
    rows = record.rows()
    assert rows[0]["leaf"] == "loss" and rows[0]["numel"] == 120 and rows[0]["traj_mean_rel"] == 0.0
    assert {"grad_norm", "layer_grad_norm.0", "layer_grad_norm.4"} <= {r["leaf"] for r in rows}
    assert len(rows[0]["trajectory_series"]) > 100 and rows[0]["traj_loss_parted_at"] is None


@pytest.mark.parametrize("fault", [dict(weight_scale=1 + 1e-4), dict(weight_decay=0.01), dict(clip=False)],
                         ids=["weight 1e-4", "weight decay 0.01", "no clipping"])
def test_planted_faults_fail_naming_where_the_curves_part(fault):
    with pytest.raises(ParityError) as failure:
        live(patches=target(**fault)).trajectory("curve", MODEL, batches(), loop=LOOP)
    message = str(failure.value)
    assert "Trajectories part" in message and "mean relative loss error" in message
    assert "loss curves part at: step " in message or "grad_norm: mean relative error" in message, message
    assert "first module whose gradient norm parts: " in message


def test_missing_clipping_is_named_at_its_step_and_layer():
    # clipping acts from the first steps (the loss is large), so the curves part within a few steps
    with pytest.raises(ParityError) as failure:
        live(patches=target(clip=False)).trajectory("curve", MODEL, batches(), loop=LOOP)
    result = failure.value.result
    assert result.mean_rel_loss_error > 1e-3 and result.loss_parted_at is not None and result.loss_parted_at < 5
    assert result.grad_norm_parted_at is not None and result.first_parting_layer is not None
    assert f"loss curves part at: step {result.loss_parted_at}" in str(failure.value)


def test_the_bf16_limit_passes_a_weight_fault_that_fp32_fails():
    # bf16 rounding hides a 1e-4 weight fault (judge.trajectory's measurement); the fp32 recipe catches it
    assert live("bf16", target(weight_scale=1 + 1e-4)).trajectory("curve", MODEL, batches(), loop=LOOP).status == "pass"
    with pytest.raises(ParityError):
        live("fp32", target(weight_scale=1 + 1e-4)).trajectory("curve", MODEL, batches(), loop=LOOP)


def test_a_baseline_stores_the_curves_and_judges_a_faulted_target(tmp_path):
    store = SuiteStores(tmp_path)
    recording = ParityCase(ParitySession(CPU, update_baselines=True, store=store), TEST_ID, "fp32")
    assert recording.trajectory("curve", MODEL, batches(), loop=LOOP).status == "recorded"
    assert recording.finish() == "created"
    record = ParityCase(ParitySession(CPU, store=store), TEST_ID, "fp32").trajectory("curve", MODEL, batches(),
                                                                                     loop=LOOP)
    assert record.status == "pass" and record.reference == "baseline"
    with pytest.raises(ParityError, match="Trajectories part"):
        ParityCase(ParitySession(CPU, store=store), TEST_ID, "fp32", patches=target(weight_decay=0.01)).trajectory(
            "curve", MODEL, batches(), loop=LOOP)


def test_a_shuffling_dataloader_is_drawn_once_for_both_sides():
    data = torch.utils.data.TensorDataset(*map(torch.cat, zip(*batches())))
    loader = torch.utils.data.DataLoader(data, batch_size=32, shuffle=True,
                                         generator=torch.Generator().manual_seed(1))
    assert live().trajectory("curve", MODEL, loader, loop=LOOP).status == "pass"


def test_nothing_trained_is_a_vacuous_trajectory():
    frozen = TrajectoryLoop(steps=20, learning_rate=0.0, loss_fn=torch.nn.functional.mse_loss)
    one = batches()[:1]
    with pytest.raises(ParityError, match="nothing was trained"):
        live().trajectory("curve", MODEL, one, loop=frozen)
    assert live().trajectory("curve2", MODEL, one, loop=frozen, vacuous_ok="lr 0 on purpose").status == "pass"


def test_a_policy_of_the_callers_own_is_applied():
    loose = TrajectoryPolicy(1.0, None, reason="loose")
    assert live(patches=target(weight_decay=0.01)).trajectory("curve", MODEL, batches(), loop=LOOP,
                                                           policy=loose).status == "pass"


def test_no_batches_is_a_clear_error():
    with pytest.raises(ValueError, match="no batches"):
        live().trajectory("curve", MODEL, [], loop=LOOP)


def _mse_per_window(module, held_out):
    x, y = held_out
    return {"mse": (module(x) - y).square().mean((1, 2)), "mae": (module(x) - y).abs().mean((1, 2))}


def _held_out():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 16, 16, generator=g)  # 4 windows of 16 rows
    return x, 4 * torch.sin(x @ torch.randn(16, 1, generator=g))


def test_a_fault_only_in_inference_passes_the_curves_and_fails_the_forecast():
    @contextlib.contextmanager
    def eval_fault(device):  # a patched inference path: the last layer's output off by 0.01 outside training
        forward = torch.nn.Linear.forward

        def patched(self, x):
            out = forward(self, x)
            return out if self.training or self.out_features != 1 else out + 0.01  # the last layer
        torch.nn.Linear.forward = patched
        try:
            yield
        finally:
            torch.nn.Linear.forward = forward

    loop = TrajectoryLoop(steps=40, learning_rate=1e-3, loss_fn=torch.nn.functional.mse_loss, evaluate=_mse_per_window)
    clean = live().trajectory("curve", MODEL, batches(), loop=loop, held_out=_held_out(), window_labels=list("abcd"))
    assert clean.status == "pass" and [m.name for m in clean.result.forecast.metrics] == ["mse", "mae"]
    assert {"forecast.mse", "forecast.mae"} <= {r["leaf"] for r in clean.rows()}
    with pytest.raises(ParityError) as failure:
        live(patches=eval_fault).trajectory("curve", MODEL, batches(), loop=loop, held_out=_held_out(),
                                            window_labels=list("abcd"))
    result = failure.value.result
    assert all(c.passed for c in result.curves) and not result.forecast.passed
    assert "windows whose MSE differs most" in str(failure.value)  # no CRPS: ranked by the first metric
    assert "mse" in str(failure.value) and "> 0.0001" in str(failure.value)
    top = result.forecast.windows[0][0]
    assert top in "abcd" and "Drill down" not in str(failure.value)  # no drill_down command given
    with pytest.raises(ParityError, match=rf"Drill down into the window whose forecast differs most \({top}\):\n"
                                          rf"  rerun --window {top}"):
        live(patches=eval_fault).trajectory("curve", MODEL, batches(), loop=loop, held_out=_held_out(),
                                            window_labels=list("abcd"), drill_down="rerun --window {window}")


def test_held_out_inputs_and_an_evaluating_loop_go_together():
    with pytest.raises(ValueError, match="held_out and a loop with evaluate= go together"):
        live().trajectory("curve", MODEL, batches(), loop=LOOP, held_out=_held_out())


def test_fp16_trains_through_a_loss_scaler_and_a_missing_unscale_fails():
    clean = live("fp16").trajectory("curve", MODEL, batches(), loop=LOOP)
    assert clean.status == "pass" and clean.result.mean_rel_loss_error == 0.0

    with pytest.raises(ParityError) as failure:
        live("fp16", lambda device: training_faults.clip_before_unscale()).trajectory(
            "curve", MODEL, batches(), loop=LOOP)
    result = failure.value.result  # the norms are taken where clipping sees them: scaled, from step 0 on
    assert not result.passed and result.grad_norm_parted_at == 0 and result.mean_rel_loss_error > 1e-4


def test_the_loop_records_the_loss_scale_under_fp16():
    from pytest_npu_parity.runtime.recipes import RECIPES

    model = net()
    out = TrajectoryLoop(steps=5, learning_rate=1e-3, loss_fn=torch.nn.functional.mse_loss)(
        model, {"batches": batches()}, RECIPES["fp16"])
    assert out["amp_scale"].shape == (5,) and float(out["amp_scale"][0]) <= 2.0 ** 16


# -- what a newcomer's model or mistake meets ----------------------------------------------------------------

class BatchNormNet(torch.nn.Module):
    momentum = 0.1  # a target patch may change it (another config)

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.bn, self.out = torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 1)

    def forward(self, x):
        self.bn.momentum = type(self).momentum
        return self.out(torch.relu(self.bn(self.lin(x))))


def test_a_batchnorm_statistics_fault_fails_through_the_buffer_norms():
    # in training mode the loss does not read the running statistics: only their norms show the fault
    @contextlib.contextmanager
    def momentum_09(device):
        BatchNormNet.momentum = 0.9
        try:
            yield
        finally:
            BatchNormNet.momentum = 0.1

    model = BatchNormNet()
    assert live().trajectory("bn", model, batches(), loop=LOOP).status == "pass"
    with pytest.raises(ParityError) as failure:
        live(patches=momentum_09).trajectory("bn", model, batches(), loop=LOOP)
    failing = [c.name for c in failure.value.result.curves if not c.passed]
    assert failing == ["buffer_norm.bn"] and "at step" in str(failure.value)


def test_a_run_that_diverges_on_both_sides_fails():
    nan_loss = TrajectoryLoop(steps=10, loss_fn=lambda out, y: (out * float("nan")).mean())
    with pytest.raises(ParityError, match="the reference's loss is not finite from step 0 on"):
        live().trajectory("nan", MODEL, batches(), loop=nan_loss)


def test_learning_rate_zero_over_several_batches_is_vacuous_and_says_so_first():
    frozen = TrajectoryLoop(steps=20, learning_rate=0.0, loss_fn=torch.nn.functional.mse_loss)
    with pytest.raises(ParityError) as failure:
        live().trajectory("lr0", MODEL, batches(), loop=frozen)
    assert str(failure.value).startswith("Trajectory check failed (") and "learning rate is 0" in str(failure.value)


def test_any_forecast_metric_the_loop_returns_is_judged():
    @contextlib.contextmanager
    def doubled(device):  # the target's evaluation path off by 2x
        doubled.on = True
        try:
            yield
        finally:
            doubled.on = False
    doubled.on = False

    def accuracy(module, held_out):
        x, y = held_out
        return {"accuracy": ((module(x) - y).square().mean((1, 2)) * (2.0 if doubled.on else 1.0)).tolist()}

    loop = TrajectoryLoop(steps=5, learning_rate=1e-3, loss_fn=torch.nn.functional.mse_loss, evaluate=accuracy)
    assert live().trajectory("acc", MODEL, batches(), loop=loop, held_out=_held_out()).status == "pass"
    with pytest.raises(ParityError, match="accuracy"):
        live(patches=doubled).trajectory("acc", MODEL, batches(), loop=loop, held_out=_held_out())
    with pytest.raises(ParityError, match="window_labels: 2 labels for 4 held-out windows"):
        live(patches=doubled).trajectory("acc2", MODEL, batches(), loop=loop, held_out=_held_out(),
                                         window_labels=["a", "b"])
    with pytest.raises(ValueError, match="pass held_out= too"):
        live().trajectory("acc3", MODEL, batches(), loop=LOOP, window_labels=["a"])


def test_bad_models_and_loops_get_clear_errors():
    frozen = net().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameter"):
        live().trajectory("frozen", frozen, batches(), loop=LOOP)
    with pytest.raises(ValueError, match="steps must be a positive int"):
        TrajectoryLoop(steps=True)

    class DictLoss(torch.nn.Module):  # a model whose output is {"loss": …}
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 1)

        def forward(self, x, y):
            return {"loss": torch.nn.functional.mse_loss(self.lin(x), y)}
    dict_batches = [{"x": x, "y": y} for x, y in batches()]
    assert live().trajectory("dict", DictLoss(), dict_batches, loop=TrajectoryLoop(steps=5)).status == "pass"


def test_compare_trajectory_takes_lists_and_refuses_other_things():
    case = live()
    curve = [1.0, 0.9, 0.8, 0.7]
    assert case.compare_trajectory("lists", {"loss": curve}, {"loss": curve}).status == "pass"
    with pytest.raises(ParityError):
        case.compare_trajectory("lists2", {"loss": [1.0, 0.9, 0.8, 0.6]}, {"loss": curve})
    with pytest.raises(TypeError, match="must map curve names"):
        case.compare_trajectory("bad", [1.0], {"loss": curve})
