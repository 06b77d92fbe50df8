"""Tests of the Trainer loop (pytest_npu_parity.hf_trainer) through ``ParityCase.train_step(loop=...)``.

The parity claim of ``parity_suites/aurora/test_trainer.py`` has teeth: one decoder FFN weight of the tiny
Aurora scaled by (1 + 1e-4) on the target side only makes the fp32 check fail under the suite's own verdict
(golden floor for fp32 training checks), while the clean port passes. The reference is a live CPU run of the
unpatched model; the target runs under the NPU patch set, as in the suite.
"""
from __future__ import annotations

import contextlib
import contextvars
import json

import pytest
import torch
from locations import REPO

from pytest_npu_parity import hf_trainer
from pytest_npu_parity.aurora import checks, factory, patches
from pytest_npu_parity.aurora.golden_shims import aurora_golden_shims
from pytest_npu_parity.compare import ParityError
from pytest_npu_parity.deepspeed_config import lint_file
from pytest_npu_parity.runner import ParityCase, ParitySession

SUITE = REPO / "parity_suites" / "aurora"
STEPS, BATCH = 5, 4
_ON_TARGET = contextvars.ContextVar("on_target", default=False)


@pytest.fixture(scope="module")
def model():
    return factory.get_model("tiny", seed=0)


@pytest.fixture(scope="module")
def inputs():
    from pytest_npu_parity.aurora.inputs import make_batch

    return make_batch(batch=STEPS * BATCH).normalized().forward_kwargs(checks.HORIZON, train=True)


@contextlib.contextmanager
def target_side(device):
    """The suite's patch set, marking the run as the target's (the fault applies there only)."""
    token = _ON_TARGET.set(True)
    try:
        with patches.patched(device):
            yield
    finally:
        _ON_TARGET.reset(token)


class ScaledWeightLoop:
    """``loop`` with one weight of the target's copy scaled by ``factor`` before training (a port bug)."""

    def __init__(self, loop: hf_trainer.TrainerLoop, name: str, factor: float):
        self.loop, self.name, self.factor = loop, name, factor

    def __call__(self, module, batch, recipe=None):
        if _ON_TARGET.get():
            with torch.no_grad():
                module.get_parameter(self.name).mul_(self.factor)
        return self.loop(module, batch, recipe)


def _session() -> ParitySession:
    session = ParitySession(torch.device("cpu"), reference="cpu")
    session.golden_runner.shims = aurora_golden_shims  # as the suite's aurora_tiny fixture
    return session


LOOPS = {"trainer": hf_trainer.TrainerLoop(steps=STEPS, batch_size=BATCH),
         "deepspeed_zero2": hf_trainer.TrainerLoop(steps=STEPS, batch_size=BATCH,
                                                   deepspeed_config=SUITE / "deepspeed_zero2.json")}


@pytest.mark.parametrize("kind", list(LOOPS))
def test_scaled_weight_fails_the_trainer_check(model, inputs, kind):
    if kind != "trainer" and hf_trainer.deepspeed_unavailable():
        pytest.skip(hf_trainer.deepspeed_unavailable())
    session = _session()
    loop = LOOPS[kind]
    clean = ParityCase(session, "clean", "fp32", patches=target_side).train_step(
        f"{kind}_{STEPS}_steps", model, inputs, loop=loop)
    assert clean.status == "pass"
    assert [leaf.path for leaf in clean.result.leaves if leaf.path.startswith("loss.")] == \
        [f"loss.step{i}" for i in range(1, STEPS + 1)]
    faulty = ScaledWeightLoop(loop, checks.TRAIN_STEP_FAULT, 1 + 1e-4)
    with pytest.raises(ParityError, match=rf"Parity check '{kind}_{STEPS}_steps' failed"):
        ParityCase(session, "scaled", "fp32", patches=target_side).train_step(
            f"{kind}_{STEPS}_steps", model, inputs, loop=faulty)


@contextlib.contextmanager
def target_optimizer_without_step(device):
    """The suite's patch set, with the target's AdamW never stepping (a kernel that never writes back)."""
    real = torch.optim.AdamW.step
    torch.optim.AdamW.step = lambda self, closure=None: None
    try:
        with patches.patched(device):
            yield
    finally:
        torch.optim.AdamW.step = real


def test_a_target_optimizer_that_does_not_step_fails_the_later_steps_losses(model, inputs):
    # a loop owns its optimizer, so its parameters get no optimizer replay: the losses of steps 2-5 catch it
    with pytest.raises(ParityError) as info:
        ParityCase(_session(), "no_step", "fp32", patches=target_optimizer_without_step).train_step(
            f"trainer_{STEPS}_steps", model, inputs, loop=LOOPS["trainer"])
    failing = {leaf.path for leaf in info.value.result.leaves if not leaf.passed}
    assert {f"loss.step{i}" for i in range(2, STEPS + 1)} <= failing and "loss.step1" not in failing


def test_deepspeed_check_keeps_its_teeth_at_the_suite_tolerance(model, inputs):
    """The suite's DeepSpeed check allows 1e-4 (no golden; measured drift on another CPU kernel path):
    the same fault then still fails it, through the layer check of the first forward."""
    if hf_trainer.deepspeed_unavailable():
        pytest.skip(hf_trainer.deepspeed_unavailable())
    from parity_suites.aurora.test_trainer import FP32_DEEPSPEED

    session = _session()
    faulty = ScaledWeightLoop(LOOPS["deepspeed_zero2"], checks.TRAIN_STEP_FAULT, 1 + 1e-4)
    with pytest.raises(ParityError, match=r"Layer check failed: 1 of \d+ weighted layers") as info:
        ParityCase(session, "scaled", "fp32", patches=target_side).train_step(
            f"deepspeed_zero2_{STEPS}_steps", model, inputs, loop=faulty, **FP32_DEEPSPEED)
    assert checks.TRAIN_STEP_FAULT.rsplit(".", 1)[0] in str(info.value)


def test_loop_returns_every_step_loss_and_the_last_step_state(model, inputs):
    from pytest_npu_parity.rng import same_randomness

    m = factory.clone_model(model).train()
    with same_randomness(0):
        leaves = hf_trainer.TrainerLoop(steps=2, batch_size=BATCH)(m, inputs)
    assert [k for k in leaves if k.startswith("loss.")] == ["loss.step1", "loss.step2"]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {k[len("param."):] for k in leaves if k.startswith("param.")} == trainable
    assert {k[len("grad."):] for k in leaves if k.startswith("grad.")} <= trainable
    assert any(k.startswith("buffer.") and k.endswith("running_mean") for k in leaves)
    changed = [n for n in trainable if not torch.equal(leaves[f"param.{n}"], model.get_parameter(n))]
    assert len(changed) > 0.9 * len(trainable)  # the steps trained the copy


def test_loop_refuses_bad_input(model, inputs):
    with pytest.raises(ValueError, match="steps must be a positive int"):
        hf_trainer.TrainerLoop(steps=0)
    with pytest.raises(ValueError, match=r"6 steps of 4 rows need 24 rows"):
        hf_trainer.TrainerLoop(steps=6, batch_size=4)(factory.clone_model(model).train(), inputs)
    from pytest_npu_parity.recipes import RECIPES

    with pytest.raises(ValueError, match="casts the weights"):
        hf_trainer.TrainerLoop()(factory.clone_model(model).train(), inputs, RECIPES["bf16-weights"])
    with pytest.raises(ValueError, match="ZeRO stage 3 is not supported"):
        hf_trainer.TrainerLoop(deepspeed_config={"zero_optimization": {"stage": 3}}).config(bf16=False)


def test_deepspeed_config_follows_the_recipe_and_the_suite_config_is_clean():
    path = SUITE / "deepspeed_zero2.json"
    assert lint_file(path) == []  # the guide's rules
    loop = hf_trainer.TrainerLoop(deepspeed_config=path)
    fp32, bf16 = loop.config(bf16=False), loop.config(bf16=True)
    assert fp32["bf16"]["enabled"] is False and fp32["fp16"]["enabled"] is False
    assert bf16["bf16"]["enabled"] is True and fp32["zero_optimization"]["stage"] == 2
    assert json.loads(path.read_text())["bf16"]["enabled"] is True  # the file itself is untouched
