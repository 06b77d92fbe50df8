"""train_step's optimizer replay: param.* after the step judged against the CPU optimizer's step
from the target's own gradients (runner.replay_optimizer_step, ParityCase._optimizer_replay)."""
from __future__ import annotations

import contextlib

import pytest
import torch

from pytest_npu_parity.compare import ParityError
from pytest_npu_parity.runner import ParityCase, ParitySession, default_optimizer, replay_optimizer_step
from switches import switched
from pytester_helpers import edited_weight

CPU = torch.device("cpu")


class Nudge(torch.autograd.Function):
    """Identity forward; the backward adds ``Nudge.delta`` to every element of the incoming gradient
    (0 outside a target patch): a rounding-level gradient difference between two correct devices."""

    delta = 0.0

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad + Nudge.delta


class HalfNormed(torch.nn.Module):
    """``Linear(4, 6)``; channels 0–2 go through a training-mode BatchNorm (the loss does not depend
    on those bias elements: their gradient is rounding noise), channels 3–5 straight to the head
    (normal gradients). So ``lin.bias`` as a whole is not rounding noise (``rounding_level_params``
    keeps it), yet three of its elements are: AdamW's first step, ≈ lr·g/(|g| + eps), moves each of
    them by up to ±lr in the direction of the noise."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 6)
        self.bn = torch.nn.BatchNorm1d(3)
        self.head = torch.nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = Nudge.apply(self.lin(x))
        h = torch.cat([self.bn(h[:, :3]), h[:, 3:]], dim=1)
        return self.head(torch.tanh(h)).pow(2).mean()


X = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))


def nudge(delta: float = 1e-8):
    return switched(Nudge, "delta", delta)


def case(patches=None, **session_kwargs) -> ParityCase:
    session = ParitySession(CPU, reference="cpu", **session_kwargs)
    return ParityCase(session, "tests/test_optimizer_replay.py::t", "fp32", patches=patches)


def first_two_calls_adamw():
    """An optimizer factory whose first two optimizers (the reference's and the target's step) are
    ``default_optimizer`` and every later one steps with twice the lr: the replay cannot reproduce
    the reference, so the check falls back to comparing with the reference's own step."""
    calls = []

    def factory(params):
        calls.append(1)
        if len(calls) <= 2:
            return default_optimizer(params)
        return torch.optim.AdamW(params, lr=2e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    return factory


def failing_leaves(record) -> set[str]:
    return {leaf.path for leaf in record.result.leaves if not leaf.passed}


def captured(session: ParitySession) -> dict:
    got: dict = {}

    def hook(_case, _record, _call, actual, expected):
        got.update(actual=actual, expected=expected)
        return None
    session.check_hooks.append(hook)
    return got


@pytest.mark.parametrize("policy", ["allclose", None])  # None: the fp32 training default (golden floor)
def test_replay_passes_a_rounding_level_gradient_difference_that_adamw_amplifies(policy):
    reference = case().train_step("step", HalfNormed(), X, policy=policy)  # the reference's own leaves
    assert reference.status == "pass"
    c = case(nudge())
    got = captured(c.session)
    record = c.train_step("step", HalfNormed(), X, policy=policy)
    assert record.status == "pass"
    assert "optimizer replay" in record.extra["policy_note"] and "not used" not in record.extra["policy_note"]
    assert {"param.lin.bias", "grad.lin.bias"} <= {row["leaf"] for row in record.rows()}
    # The target's gradient moved by rounding only (within tolerance) ...
    g_t, g_r = got["actual"]["grad.lin.bias"], got["expected"]["grad.lin.bias"]
    assert 0 < float((g_t - g_r).abs().max()) < 1e-6
    # ... and its bias after the step is up to ±lr away from the reference's own step: beyond tolerance.
    ref_step = case(nudge(0.0))
    ref_got = captured(ref_step.session)
    ref_step.train_step("step", HalfNormed(), X, optimizer=first_two_calls_adamw(), policy="allclose")
    own = ref_got["expected"]["param.lin.bias"]  # the fallback keeps the reference's own step
    gap = float((got["actual"]["param.lin.bias"] - own).abs().max())
    assert gap > 1e-5 + 1e-5 * float(own.abs().max())
    assert torch.allclose(got["actual"]["param.lin.bias"], got["expected"]["param.lin.bias"], rtol=1e-5, atol=1e-5)


def test_without_replay_the_amplified_noise_fails_and_the_note_says_why():
    c = case(nudge())
    with pytest.raises(ParityError, match=r"param\.lin\.bias") as info:
        c.train_step("step", HalfNormed(), X, optimizer=first_two_calls_adamw(), policy="allclose")
    record = c.records[-1]
    note = record.extra["policy_note"]
    assert "optimizer replay not used" in note and "does not reproduce" in note
    failing = failing_leaves(record)
    assert failing == {"param.lin.bias"}, (failing, str(info.value)[:400])


class WeightScaled(torch.nn.Module):
    """A small conv + BatchNorm + MLP; ``WeightScaled.fault`` scales ``conv.weight`` in place before
    the target's forward (a wrong starting weight on the device)."""

    fault = 1.0

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(2, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)
        self.fc1 = torch.nn.Linear(16, 8)
        self.fc2 = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if WeightScaled.fault != 1.0:
            with torch.no_grad():
                self.conv.weight.mul_(WeightScaled.fault)
            WeightScaled.fault = 1.0  # once per step
        h = torch.relu(self.bn(self.conv(x))).flatten(1)
        return self.fc2(torch.tanh(self.fc1(h))).pow(2).mean()


IMG = torch.randn(4, 2, 4, 4, generator=torch.Generator().manual_seed(2))


def scaled_weight(factor: float):
    return switched(WeightScaled, "fault", factor)


@pytest.mark.parametrize("policy", ["allclose", None])
def test_a_wrong_starting_weight_still_fails_the_param_leaf(policy):
    assert case().train_step("step", WeightScaled(), IMG, policy=policy).status == "pass"
    c = case(scaled_weight(1 + 1e-4))
    with pytest.raises(ParityError):
        c.train_step("step", WeightScaled(), IMG, policy=policy)
    record = c.records[-1]
    assert "optimizer replay" in record.extra["policy_note"] and "not used" not in record.extra["policy_note"]
    failing = failing_leaves(record)
    assert "param.conv.weight" in failing


def wrong_lr(factor: float = 1.5):
    """The target's AdamW steps with ``factor``·lr (a wrong optimizer kernel on the device)."""
    @contextlib.contextmanager
    def patches(device: torch.device):
        original = torch.optim.AdamW.step

        def step(self, closure=None):
            for group in self.param_groups:
                group["lr"] *= factor
            try:
                return original(self, closure)
            finally:
                for group in self.param_groups:
                    group["lr"] /= factor
        torch.optim.AdamW.step = step
        try:
            yield
        finally:
            torch.optim.AdamW.step = original
    return patches


@pytest.mark.parametrize("policy", ["allclose", None])
def test_a_wrong_optimizer_step_on_the_target_fails_the_param_leaves_only(policy):
    c = case(wrong_lr())
    with pytest.raises(ParityError):
        c.train_step("step", WeightScaled(), IMG, policy=policy)
    failing = failing_leaves(c.records[-1])
    assert failing and all(leaf.startswith("param.") for leaf in failing)


class CountingSGD(torch.optim.SGD):
    """SGD whose every step adds ``1e-3·(steps taken so far by any CountingSGD)`` to each parameter:
    not a function of weights and gradients alone, so a replay cannot reproduce it."""

    steps = 0

    @torch.no_grad()
    def step(self, closure=None):
        out = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(1e-3 * CountingSGD.steps)
        CountingSGD.steps += 1
        return out


def test_an_optimizer_replay_cannot_reproduce_falls_back_to_the_reference_step():
    CountingSGD.steps = 0
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 1))
    c = case()
    # the target's step is the second: 1e-3 further than the reference's, a failure as before
    with pytest.raises(ParityError):
        c.train_step("step", net, {"input": X}, loss_fn=lambda out: out.pow(2).mean(),
                     optimizer=lambda p: CountingSGD(p, lr=0.01), policy="allclose")
    note = c.records[-1].extra["policy_note"]
    assert "optimizer replay not used" in note and "not a function of the weights and gradients" in note
    # the old behaviour: the bias before BatchNorm (rounding-noise gradient) is left out
    assert "1 parameter(s) after the step not compared (param.0.bias)" in note


def test_replay_optimizer_step_is_the_optimizer_step_from_the_given_gradients():
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    grads = {"grad.weight": torch.full((2, 3), 0.5), "grad.bias": None, "param.weight": torch.zeros(2, 3)}
    out = replay_optimizer_step(net, grads, lambda p: torch.optim.SGD(p, lr=0.1))
    assert set(out) == {"param.weight", "param.bias"}
    assert torch.equal(out["param.weight"], net.weight.detach() - 0.05)
    assert torch.equal(out["param.bias"], net.bias.detach())  # no gradient: not stepped
    assert net.weight.grad is None  # the module itself is untouched
    half = replay_optimizer_step(net, {"grad.weight": torch.ones(2, 3)}, lambda p: torch.optim.SGD(p, lr=0.1),
                                 torch.float64)
    assert half["param.weight"].dtype == torch.float64


def test_replay_steps_a_tied_weight_once_skips_frozen_ones_and_leaves_the_module_alone():
    # Two submodules share one weight (named_parameters lists it once, under its first name): it is
    # stepped once from that name's gradient; a frozen parameter is no leaf of the replay; the
    # module's own parameters keep their values and get no .grad.
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    net[1].weight = net[0].weight
    net[2].bias.requires_grad_(False)
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    grads = {f"grad.{n}": torch.full_like(p, 0.25) for n, p in net.named_parameters() if p.requires_grad}
    out = replay_optimizer_step(net, grads, lambda params: torch.optim.AdamW(params, lr=0.1))
    assert set(out) == {"param.0.weight", "param.0.bias", "param.1.bias", "param.2.weight"}
    expected = torch.optim.AdamW([torch.nn.Parameter(before["0.weight"].clone())], lr=0.1)
    expected.param_groups[0]["params"][0].grad = torch.full((3, 3), 0.25)
    expected.step()
    assert torch.equal(out["param.0.weight"], expected.param_groups[0]["params"][0].detach())
    assert all(torch.equal(p, before[n]) and p.grad is None for n, p in net.named_parameters())
    assert net[1].weight is net[0].weight


def test_replay_under_a_weights_dtype_casts_the_module_as_the_run_does():
    # A module may keep some parameters in float32 when cast (its own ``_apply``, as the run's
    # ``Module.to`` honours): the replay's copies keep them there too, and step them in float32.
    class KeepNormFp32(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.norm = torch.nn.LayerNorm(4)

        def _apply(self, fn, *args, **kwargs):
            super()._apply(fn, *args, **kwargs)
            self.norm.float()
            return self

    torch.manual_seed(0)
    net = KeepNormFp32()
    grads = {f"grad.{n}": torch.ones_like(p) for n, p in net.named_parameters()}
    out = replay_optimizer_step(net, grads, lambda p: torch.optim.SGD(p, lr=0.1), torch.bfloat16)
    assert out["param.lin.weight"].dtype == torch.bfloat16
    assert out["param.norm.weight"].dtype == torch.float32
    assert torch.equal(out["param.norm.weight"], net.norm.weight.detach() - 0.1)


def _compact_baseline(tmp_path, model, inputs, store: str, **kwargs):
    from pytest_npu_parity.baselines import BaselineStore

    store_dir = BaselineStore(tmp_path, "suite")
    rec = ParityCase(ParitySession(CPU, update_baselines=True, store=store_dir), "tests/t.py::t", "fp32")
    rec.train_step("step", model, inputs, store=store, policy="allclose", **kwargs)
    rec.finish()
    return lambda patches=None: ParityCase(ParitySession(CPU, reference="baseline", store=store_dir),
                                           "tests/t.py::t", "fp32", patches=patches)


def test_replay_against_a_compact_baseline_is_validated_on_the_whole_leaves_and_reduced_like_them(tmp_path):
    model = WeightScaled()
    against = _compact_baseline(tmp_path, model, IMG, "summary min_numel=16 samples=8")
    record = against().train_step("step", model, IMG, policy="allclose")
    assert record.status == "pass"
    note = record.extra["policy_note"]
    assert "(optimizer replay)" in note and "validated on the 6 parameter(s) the compact baseline stores whole" in note
    leaves = {leaf.path for leaf in record.result.leaves}
    assert {"param.conv.weight@sample", "param.conv.weight@stats", "param.fc2.weight"} <= leaves
    c = against(wrong_lr())
    with pytest.raises(ParityError):
        c.train_step("step", model, IMG, policy="allclose")
    failing = failing_leaves(c.records[-1])
    assert "param.conv.weight@sample" in failing and all(leaf.startswith("param.") for leaf in failing)


def test_replay_is_not_used_when_a_compact_baseline_keeps_no_gradient_whole(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    against = _compact_baseline(tmp_path, model, X, "summary min_numel=2 samples=1",
                                loss_fn=lambda out: out.pow(2).mean())
    record = against().train_step("step", model, X, loss_fn=lambda out: out.pow(2).mean(), policy="allclose")
    assert record.status == "pass"
    assert "optimizer replay not used (the compact baseline stores no parameter's gradient whole" in \
        record.extra["policy_note"]


@pytest.mark.parametrize("policy", ["allclose", None])
def test_a_patch_that_edits_the_weights_reaches_the_copy_the_target_trains(policy):
    # Each side trains a deep copy of the module; the target's copy is made once its patch set is
    # entered, so a weight the patch edits is the weight it trains (before: the copy was taken first,
    # and a x(1 + 1e-1) weight fault passed every leaf).
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 4, (8,), generator=torch.Generator().manual_seed(2))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    step = dict(labels=labels, loss_fn=torch.nn.CrossEntropyLoss(), policy=policy, layers=False)
    assert case(edited_weight(model, "2.weight", 1.0)).train_step("step", model, x, **step).status == "pass"
    c = case(edited_weight(model, "2.weight", 1 + 1e-4))
    with pytest.raises(ParityError):
        c.train_step("step", model, x, **step)
    assert "param.2.weight" in failing_leaves(c.records[-1])
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # the user's module is untouched


def test_tests_of_one_module_with_other_optimizers_or_losses_do_not_share_a_reference():
    # The session memoizes live CPU references (and goldens) per check; a train step's optimizer,
    # loss and clipping are part of what it computes, so parametrizing a test over them must not
    # compare a step with another optimizer's reference (every parameter then differs by ~lr).
    session = ParitySession(CPU, reference="cpu")
    model = HalfNormed()
    sgd = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731
    adam = lambda p: torch.optim.Adam(p, lr=1e-3, amsgrad=True)  # noqa: E731
    for i, kwargs in enumerate([dict(optimizer=sgd), dict(optimizer=adam), dict(optimizer=adam, max_grad_norm=None),
                                dict(optimizer=adam, loss_fn=lambda out: 2 * out)]):
        record = ParityCase(session, f"tests/test_optimizer_replay.py::t{i}", "fp32").train_step("step", model, X, **kwargs)
        assert record.status == "pass", kwargs
    assert len(session._reference_memo) == 4


def test_a_module_with_a_scripted_submodule_trains_and_its_weight_fault_fails():
    # copy.deepcopy gives a torch.jit.script submodule's parameters a grad_fn (no leaves: "can't
    # optimize a non-leaf Tensor"); train_step's copies keep them leaves that require grad.
    import warnings

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.script is deprecated in torch 2.14
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.jit.script(torch.nn.Linear(16, 16)),
                                    torch.nn.Tanh(), torch.nn.Linear(16, 2))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    loss = lambda out: out.square().mean()  # noqa: E731
    record = case().train_step("step", model, x, loss_fn=loss)
    assert record.status == "pass" and "param.1.weight" in {row["leaf"] for row in record.rows()}
    assert all(p.is_leaf and p.requires_grad for p in model.parameters())
    c = case(edited_weight(model, "1.weight", 1 + 1e-4))
    with pytest.raises(ParityError):
        c.train_step("step", model, x, loss_fn=loss)
    assert {"param.1.weight", "grad.1.weight"} & failing_leaves(c.records[-1])


@contextlib.contextmanager
def _no_step(device: torch.device):
    """The target's AdamW does not step (a kernel that never writes the parameters back)."""
    original = torch.optim.AdamW.step
    torch.optim.AdamW.step = lambda self, closure=None: None
    try:
        yield
    finally:
        torch.optim.AdamW.step = original


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


@pytest.mark.parametrize("recipe", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("lr_scale", [None, 1.5], ids=["no step", "1.5x lr"])
def test_a_target_optimizer_that_steps_otherwise_fails_under_autocast_too(recipe, lr_scale):
    # under bf16 or fp16 autocast the parameters are fp32 and the recipe's 1e-3 + 1e-3*|p| holds a whole AdamW
    # step: both faults passed there before; the replay from the target's gradients is judged at fp32's
    # tolerance (fp16's loss-scaled step had no replay until 2026-12: its faulty optimizers passed)
    x, y = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), torch.randn(4, 1)
    session = ParitySession(CPU, reference="cpu")
    record = ParityCase(session, "tests/test_optimizer_replay.py::mlp", recipe).train_step(
        "step", _mlp(), x, labels=y, loss_fn=torch.nn.MSELoss())
    assert record.status == "pass" and "optimizer replay" in record.extra["policy_note"]
    faulty = ParityCase(ParitySession(CPU, reference="cpu"), "tests/test_optimizer_replay.py::mlp", recipe,
                        patches=_no_step if lr_scale is None else wrong_lr(lr_scale))
    match = r"optimizer step differs from the CPU optimizer's step from the target's own gradients" \
        if recipe != "fp32" else r"param\."
    with pytest.raises(ParityError, match=match):
        faulty.train_step("step", _mlp(), x, labels=y, loss_fn=torch.nn.MSELoss())


def test_an_fp16_step_whose_every_attempt_overflows_is_judged_against_the_references_own_step():
    # the loss is inf in fp16 (an output of ~1e8): the scaler skips the step, so a replay from the
    # reference's (non-finite) gradients cannot reproduce it; the note says why, not "not a function of ..."
    class Overflowing(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(8, 4)

        def forward(self, x):
            return (self.lin(x) * 1e8).float().pow(2).mean()

    record = ParityCase(ParitySession(CPU, reference="cpu"), "tests/test_optimizer_replay.py::inf", "fp16").train_step(
        "step", Overflowing(), torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), loss_fn=lambda out: out,
        max_grad_norm=None)
    assert record.status == "pass"
    assert record.extra["policy_note"].startswith("optimizer replay not used (the reference's gradients are not finite")


def test_a_rounding_level_gradient_difference_passes_the_optimizer_step_check_in_bf16():
    # two correct devices: the target's gradients differ in their last bits; its own optimizer is the CPU's
    record = ParityCase(ParitySession(CPU, reference="cpu"), "tests/test_optimizer_replay.py::t", "bf16",
                        patches=nudge(1e-6)).train_step("step", HalfNormed(), X)
    assert record.status == "pass" and "optimizer replay" in record.extra["policy_note"]
