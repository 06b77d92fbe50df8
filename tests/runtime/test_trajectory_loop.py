"""runtime.trajectory: the loop's curves, its schedules against DeepSpeed's own, and the judge over them."""
import pytest
import torch

from pytest_npu_parity.judge.trajectory import DEFAULT_LIMITS, judge_trajectory
from pytest_npu_parity.runtime.trajectory import TrajectoryLoop


def curves(**loop):
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    y = 3 * torch.sin(x.sum(1, keepdim=True))
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).train()
    batches = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)]
    return TrajectoryLoop(steps=60, loss_fn=torch.nn.functional.mse_loss, learning_rate=1e-3, **loop)(
        model, {"batches": batches})


def test_curves_and_a_planted_optimizer_fault():
    clean = curves()
    assert sorted(clean) == ["checkpoint_steps", "grad_norm", "layer_grad_norm.0", "layer_grad_norm.2", "loss", "lr",
                             "weight_norm.0", "weight_norm.2"]
    assert clean["loss"].shape == (60,) and clean["checkpoint_steps"].tolist() == [11, 23, 35, 47, 59]
    assert judge_trajectory(curves(), clean, DEFAULT_LIMITS["fp32"]).passed
    assert not judge_trajectory(curves(weight_decay=0.01), clean, DEFAULT_LIMITS["fp32"]).passed
    assert not judge_trajectory(curves(max_grad_norm=None), clean, DEFAULT_LIMITS["fp32"]).passed


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_matches_deepspeed_warmup_lr_as_its_engine_steps_it(kind):
    lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=1e-4)
    sched = lr_schedules.WarmupLR(opt, warmup_min_lr=0, warmup_max_lr=1e-4, warmup_num_steps=50, warmup_type=kind)
    applied = []
    for _ in range(60):  # DeepSpeedEngine._take_model_step: optimizer.step(), then lr_scheduler.step()
        applied.append(opt.param_groups[0]["lr"])
        sched.step()
    loop = TrajectoryLoop(schedule=f"warmup_{kind}", warmup_steps=50)
    assert [loop.lr_at(k) for k in range(60)] == pytest.approx(applied, rel=1e-12, abs=0)


def test_bad_loops_are_named():
    with pytest.raises(ValueError, match="schedule"):
        TrajectoryLoop(schedule="cosine")
    with pytest.raises(ValueError, match="batches"):
        TrajectoryLoop(steps=1)(torch.nn.Linear(2, 1), {})
    with pytest.raises(ValueError, match="loss_fn"):
        TrajectoryLoop(steps=1)(torch.nn.Linear(2, 1), {"batches": [(torch.ones(1, 2), torch.ones(1, 1))]})


def _bf16_run(model, master_weights=True, steps=60):
    torch.manual_seed(1)
    x = torch.randn(64, 8)
    y = 3 * torch.sin(x.sum(1, keepdim=True))
    batches = [(x[i:i + 16].to(model[0].weight.dtype), y[i:i + 16].to(model[0].weight.dtype)) for i in range(0, 64, 16)]
    loop = TrajectoryLoop(steps=steps, learning_rate=1e-4, master_weights=master_weights,
                          loss_fn=lambda out, target: torch.nn.functional.mse_loss(out.float(), target.float()))
    return loop(model, {"batches": batches})


def _bf16_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).train()
    with torch.no_grad():  # weights of ~0.5: a bf16 ULP there (2^-8) is ~40x an AdamW step of lr 1e-4
        for p in model.parameters():
            p.copy_(0.25 + 0.5 * torch.rand_like(p))
    return model.to(torch.bfloat16)


def test_bf16_weights_train_through_float32_master_weights():
    """DeepSpeed's bf16 scheme: the bf16 weights follow a float32 run of the same start to bf16 rounding, while a
    loop without master weights loses the updates (each smaller than half a bf16 ULP of its weight)."""
    fp32 = _bf16_model().float()
    start = [p.detach().clone() for p in fp32.parameters()]
    reference = _bf16_run(fp32)
    master, plain = _bf16_model(), _bf16_model()
    with_masters, without = _bf16_run(master), _bf16_run(plain, master_weights=False)
    assert all(p.dtype == torch.bfloat16 for p in master.parameters())
    moved = [(p.float() - s).abs().max().item() for p, s in zip(master.parameters(), start)]
    lost = [torch.equal(p.float(), s) for p, s in zip(plain.parameters(), start)]
    assert min(moved) > 0 and all(lost), (moved, lost)
    loss_error = lambda run: ((run["loss"] - reference["loss"]).abs() / reference["loss"]).mean().item()  # noqa: E731
    assert loss_error(with_masters) < 1e-2 < loss_error(without), (loss_error(with_masters), loss_error(without))
    # the weight norms follow the float32 run's
    final = lambda run: run["weight_norm.0"][-1].item()  # noqa: E731
    assert final(with_masters) == pytest.approx(final(reference), rel=5e-3)


def test_loss_scaling_with_low_precision_weights_is_refused():
    from pytest_npu_parity.runtime.recipes import RECIPES

    for master_weights in (True, False):  # refused whether or not the loop would keep master weights
        with pytest.raises(ValueError, match="bf16-weights recipe without loss scaling"):
            TrajectoryLoop(steps=1, loss_fn=torch.nn.functional.mse_loss, master_weights=master_weights)(
                _bf16_model(), {"batches": [(torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(2, 1))]},
                RECIPES["fp16"])


class _TiedHead(torch.nn.Module):
    """An input and an output projection sharing one weight, as a language model ties its embedding and head;
    ``tied=False`` uses the one parameter twice through ``functional.linear`` instead (the same arithmetic)."""

    def __init__(self, tied: bool):
        super().__init__()
        torch.manual_seed(0)
        self.tied = tied
        self.proj = torch.nn.Linear(4, 4, bias=False)
        if tied:
            self.head = torch.nn.Linear(4, 4, bias=False)
            self.head.weight = self.proj.weight

    def forward(self, x):
        h = torch.tanh(self.proj(x))
        return self.head(h) if self.tied else torch.nn.functional.linear(h, self.proj.weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tied_weights_are_stepped_and_counted_once(dtype):
    """A weight two modules share is one parameter: AdamW steps it once per step (not once per owner) and the
    global gradient norm counts it once, with or without master weights."""
    torch.manual_seed(1)
    x, y = torch.randn(16, 4, dtype=dtype), torch.randn(16, 4, dtype=dtype)
    # the loss in float32: torch 2.5.1's CPU has no bf16 mse_loss
    loop = TrajectoryLoop(steps=3, learning_rate=1e-2,
                          loss_fn=lambda out, target: torch.nn.functional.mse_loss(out.float(), target.float()))
    tied, single = _TiedHead(True).to(dtype), _TiedHead(False).to(dtype)
    got, want = loop(tied, {"batches": [(x, y)]}), loop(single, {"batches": [(x, y)]})
    assert torch.equal(got["loss"], want["loss"]) and torch.equal(got["grad_norm"], want["grad_norm"]), (got, want)
    assert torch.equal(tied.proj.weight, single.proj.weight)
