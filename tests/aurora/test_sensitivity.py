"""Every Aurora check has teeth: a real fault on the target side makes its fp32 check fail.

Faults (issue: "scaling one weight by (1 + 1e-4) in any checked submodule, or dropping the causal
mask, makes that submodule's fp32 check (and the full-model checks) fail"):

* one weight matrix of the checked submodule scaled by (1 + 1e-4), on the target side only: the
  check's ``fault_weight`` or else the largest trainable one (``checks.sensitive_weight``); the
  whole-model checks are covered by the decoder-layer weight below;
* the causal attention mask replaced by zeros (``checks.dropped_causal_mask``).

The reference is a live CPU run of the unpatched upstream model; the target runs the same model under
the NPU patch set plus the fault, exactly as the suite's target does.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from pytest_npu_parity.aurora import checks, patches
from pytest_npu_parity.compare import ParityError
from pytest_npu_parity.runner import ParityCase, ParitySession, owner_module

CAUSAL = [c for c in checks.CHECKS
          if c.name.startswith("decoder_layer") or c.name == "prototype_retriever" or c in checks.MODEL_CHECKS]


@pytest.fixture(scope="module")
def ctx(aurora_ctx) -> checks.AuroraContext:
    return aurora_ctx  # tests/conftest.py: built once per process, shared with the localization proofs


@pytest.fixture(scope="module")
def session() -> ParitySession:
    return ParitySession(torch.device("cpu"), reference="cpu")  # one reference run per check, memoized


def _faulty(*faults):
    @contextlib.contextmanager
    def apply(device):
        with contextlib.ExitStack() as stack:
            stack.enter_context(patches.patched(device))
            for fault in faults:
                stack.enter_context(fault())
            yield
    return apply


def _perturbed_module(ctx: checks.AuroraContext, check: checks.AuroraCheck, fn) -> torch.nn.Module:
    """The module object the target side actually runs (a training-mode copy for train checks)."""
    module = owner_module(fn)
    return module if module is not None else ctx.model.get_submodule(check.submodule)


def _run(session, check, fn, args, kwargs, patch_factory, test_id):
    case = ParityCase(session, test_id, "fp32", patches=patch_factory)
    return case.check(check.name, fn, *args, **kwargs)


@pytest.mark.parametrize("check", [c for c in checks.SUBMODULE_CHECKS if c.submodule is not None], ids=str)
def test_scaled_weight_fails_the_check(ctx, session, check):
    fn, args, kwargs = check.build(ctx)
    _run(session, check, fn, args, kwargs, _faulty(), "clean")  # the check passes on the clean port
    module = _perturbed_module(ctx, check, fn)
    weight = check.fault_weight or checks.sensitive_weight(module)
    fault = lambda: checks.scaled_parameter(module, weight, 1 + 1e-4)  # noqa: E731
    with pytest.raises(ParityError, match=rf"Parity check '{check.name}' failed"):
        _run(session, check, fn, args, kwargs, _faulty(fault), "scaled")


@pytest.mark.parametrize("check", CAUSAL, ids=str)
def test_dropped_causal_mask_fails_the_check(ctx, session, check):
    fn, args, kwargs = check.build(ctx)
    with pytest.raises(ParityError, match=rf"Parity check '{check.name}' failed"):
        _run(session, check, fn, args, kwargs, _faulty(checks.dropped_causal_mask), "no-mask")


@pytest.mark.parametrize("check", checks.MODEL_CHECKS, ids=str)
def test_scaled_decoder_weight_fails_the_full_model_checks(ctx, session, check):
    fn, args, kwargs = check.build(ctx)
    module = _perturbed_module(ctx, check, fn)
    prefix = "" if module is ctx.model.model else "model."  # AuroraModel vs AuroraForPrediction
    name = f"{prefix}dec_layers.4.ffn_layer.ffn.0.weight"
    fault = lambda: checks.scaled_parameter(module, name, 1 + 1e-4)  # noqa: E731
    with pytest.raises(ParityError, match=rf"Parity check '{check.name}' failed"):
        _run(session, check, fn, args, kwargs, _faulty(fault), "scaled-decoder")


# The golden verdict (--parity-policy golden) on the same port: clean passes, faults fail.
GOLDEN_CASES = [
    ("fp32", "decoder_layer_0", "scaled weight"),  # fp64 golden: a 1e-4 weight error is ~1e9 fp32 roundings
    ("fp32", "forward_eval", "scaled decoder weight"),  # the whole sampled forecast, fp64 golden
    ("bf16", "decoder_layer_0", "no mask"),  # fp32 golden: a fault larger than bf16's own error
    ("bf16", "prototype_retriever", "no mask"),
]


@pytest.mark.parametrize("recipe, name, fault", GOLDEN_CASES, ids=["-".join(c) for c in GOLDEN_CASES])
def test_golden_verdict_passes_the_clean_port_and_fails_faults(ctx, recipe, name, fault):
    from pytest_npu_parity.aurora.golden_shims import aurora_golden_shims

    check = next(c for c in checks.CHECKS if c.name == name)
    fn, args, kwargs = check.build(ctx)
    session = ParitySession(torch.device("cpu"), reference="cpu", recipe_policies={recipe: "golden"})
    session.golden_runner.root, session.golden_runner.shims = ctx.model, aurora_golden_shims
    clean = ParityCase(session, "clean", recipe, patches=_faulty()).check(check.name, fn, *args, **kwargs)
    assert clean.status == "pass" and clean.policy == "golden"
    module = _perturbed_module(ctx, check, fn)
    if fault == "no mask":
        faults = [checks.dropped_causal_mask]
    elif fault == "scaled weight":
        weight = check.fault_weight or checks.sensitive_weight(module)
        faults = [lambda: checks.scaled_parameter(module, weight, 1 + 1e-4)]
    else:
        faults = [lambda: checks.scaled_parameter(module, "model.dec_layers.4.ffn_layer.ffn.0.weight", 1 + 1e-4)]
    with pytest.raises(ParityError, match=rf"Parity check '{check.name}' failed under the golden policy"):
        ParityCase(session, fault, recipe, patches=_faulty(*faults)).check(check.name, fn, *args, **kwargs)


# --------------------------------------------------------------------------------------------
# The fp16 training step against its stored baseline, and a wrong loss scale on the target

FP16_TRAIN_STEP_ID = "parity_suites/aurora/test_train_step.py::test_train_step[fp16]"


def _fp16_train_step(patch_factory):
    from pathlib import Path

    from pytest_npu_parity.aurora import factory
    from pytest_npu_parity.baselines import SuiteStores

    store = SuiteStores(Path(__file__).resolve().parents[2] / "baselines")
    session = ParitySession(torch.device("cpu"), reference="baseline", store=store)
    case = ParityCase(session, FP16_TRAIN_STEP_ID, "fp16", patches=patch_factory)
    batch = checks.suite_batch()
    return case.train_step("train_step", factory.get_model("tiny", seed=0), batch.forward_kwargs(checks.HORIZON, train=True),
                           group="training step", fault_weight=checks.TRAIN_STEP_FAULT)


def test_fp16_train_step_passes_against_its_stored_baseline():
    record = _fp16_train_step(patches.patched)
    assert record.status == "pass" and record.reference == "baseline"
    paths = {leaf.path for leaf in record.result.leaves}
    assert {"amp.scale", "amp.skipped_steps", "amp.grad_norm", "loss"} <= paths


@pytest.mark.parametrize("fault, failing", [
    ("stale_inverse_scale", {"amp.grad_norm"}),  # clipping (global norm 21.9 > 1) hides it in every grad
    ("missed_overflow", {"amp.scale", "amp.skipped_steps", "amp.grad_norm",
                         "grad.model.embed_layer.proj_layer.weight"}),
])
def test_fp16_train_step_fails_a_wrong_loss_scale(fault, failing):
    from loss_scale_faults import FAULTS, target_scaler

    with pytest.raises(ParityError) as info:
        _fp16_train_step(target_scaler(FAULTS[fault], patches.patched))
    assert {leaf.path for leaf in info.value.result.leaves if not leaf.passed} == failing


def test_ignored_padding_mask_fails_the_masked_flow_loss_check(ctx, session):
    """A port that drops ``FlowLoss.forward``'s padding mask averages the loss over the padded steps."""
    check = checks.BY_NAME["flow_loss_train_masked"]
    fn, args, kwargs = check.build(ctx)
    _run(session, check, fn, args, kwargs, _faulty(), "clean")
    with pytest.raises(ParityError, match=r"Parity check 'flow_loss_train_masked' failed") as info:
        _run(session, check, fn, args, kwargs, _faulty(checks.ignored_padding_mask), "no-padding-mask")
    assert "output" in str(info.value)  # the loss leaf ("output"), not the velocity


#: Noise-scale fault of the distribution proofs at the suite's size (4 series, 32 samples): measured
#: there, noise × 1.1 fails 3 of 4 seeds and × 1.2 every seed; × 1.05 needs more samples
#: (docs/explanation/distribution.md; the engine's proof at 16 series × 64 samples is tests/judge/test_distribution.py).
SUITE_NOISE_FAULT = 1.2


@pytest.mark.parametrize("name", [c.name for c in checks.CHECKS if c.sample_dim is not None])
def test_sampling_checks_judged_as_distributions_pass_clean_and_fail_a_wrong_noise_scale(ctx, name):
    """Under ``--parity-rng device`` (each side draws its own noise) the suite's sampling checks are
    judged as distributions: independent CPU streams pass, a wrong noise scale on the target fails."""
    check = checks.BY_NAME[name]
    fn, args, kwargs = check.build(ctx)
    device_session = ParitySession(torch.device("cpu"), reference="cpu", rng="device")
    clean = ParityCase(device_session, "clean", "fp32", patches=_faulty()).check(
        check.name, fn, *args, sample_dim=check.sample_dim, **kwargs)
    assert clean.status == "pass" and clean.policy == "distribution"
    fault = lambda: checks.scaled_sampler_noise(SUITE_NOISE_FAULT)  # noqa: E731
    with pytest.raises(ParityError, match=rf"Parity check '{check.name}' failed as a distribution"):
        ParityCase(device_session, "noise", "fp32", patches=_faulty(fault)).check(
            check.name, fn, *args, sample_dim=check.sample_dim, **kwargs)
