"""The runner's verdict policies: allclose by default, the golden verdict when chosen (engine only, no pytest glue)."""
from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F

from pytest_npu_parity import golden as G
from pytest_npu_parity.checks.reference import check_hashes
from pytest_npu_parity.compare import ParityError
from pytest_npu_parity.runner import DEFAULT_POLICIES, ParityCase, ParitySession
from switches import switched

CPU = torch.device("cpu")


class Proj(torch.nn.Module):
    """``x @ w`` (K = 256). Class switches let a "patch set" change the target side only:
    ``split`` computes it as two half-K products (a reordered reduction: a legitimate variant),
    ``scale`` multiplies the weight (a real fault)."""

    split = False
    scale = 1.0

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(256, 64, generator=g) / 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.w * Proj.scale
        if Proj.split:
            return x[:, :128] @ w[:128] + x[:, 128:] @ w[128:]
        return x @ w


def target_patch(split: bool = False, scale: float = 1.0):
    @contextlib.contextmanager
    def patches(device: torch.device):
        Proj.split, Proj.scale = split, scale
        try:
            yield
        finally:
            Proj.split, Proj.scale = False, 1.0
    return patches


X = torch.randn(32, 256, generator=torch.Generator().manual_seed(1))


def case(recipe: str, patches=None, **session_kwargs) -> ParityCase:
    session = ParitySession(CPU, reference="cpu", **session_kwargs)
    return ParityCase(session, "tests/test_runner.py::t", recipe, patches=patches)


def test_default_policies_follow_the_calibration():
    # fp32 eval checks: allclose 1e-5; bf16 and fp32 training checks: golden with the allclose floor
    assert DEFAULT_POLICIES["fp32"] == "allclose" and DEFAULT_POLICIES["bf16"] == "golden floor"
    record = case("fp32").check("proj", Proj(), X)
    assert record.golden_policy is None and record.policy == "allclose"
    assert {row["policy"] for row in record.rows()} == {"allclose"}
    bf16 = case("bf16").check("proj", Proj(), X)
    assert bf16.policy == "golden" and bf16.golden_policy.allclose_floor
    train = case("fp32").check("proj_train", torch.nn.Sequential(Proj(), torch.nn.Dropout(0.1)).train(), X)
    assert train.policy == "golden" and train.golden_policy.allclose_floor
    assert case("fp32", recipe_policies={"fp32": "allclose"}).check(
        "proj_train", torch.nn.Sequential(Proj(), torch.nn.Dropout(0.1)).train(), X).policy == "allclose"


def test_is_training_means_dropout_or_batch_statistics():
    from pytest_npu_parity.runner import is_training

    assert not is_training(torch.nn.Linear(2, 2)) and not is_training(lambda x: x)  # fresh, but no mode effect
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.2))
    assert is_training(net) and not is_training(net.eval())
    assert not is_training(torch.nn.Sequential(torch.nn.Dropout(0.0)))
    assert is_training(torch.nn.BatchNorm1d(2)) and not is_training(torch.nn.BatchNorm1d(2).eval())


def test_allclose_floor_passes_a_leaf_within_tolerance_that_the_ratio_test_fails():
    # fp32, a 3e-6 relative scale: inside allclose 1e-5 but far above the fp32 rounding of the reference
    patches = target_patch(scale=1 + 3e-6)
    with pytest.raises(ParityError):
        case("fp32", patches, recipe_policies={"fp32": "golden"}).check("proj", Proj(), X)
    floor = case("fp32", patches, recipe_policies={"fp32": "golden floor"}).check("proj", Proj(), X)
    assert floor.status == "pass" and floor.result.leaves[0].within_floor
    # beyond the allclose tolerance the ratio test decides again
    with pytest.raises(ParityError, match="golden policy"):
        case("fp32", target_patch(scale=1 + 1e-4), recipe_policies={"fp32": "golden floor"}).check("proj", Proj(), X)


def test_golden_passes_a_bf16_split_k_variant_that_allclose_1e3_fails():
    # Two half-K products, each rounded to bf16, then summed: 29 % of the elements move by a bf16 step.
    with pytest.raises(ParityError, match="Mismatched elements"):
        case("bf16", target_patch(split=True), recipe_policies={"bf16": "allclose"}).check("proj", Proj(), X)
    record = case("bf16", target_patch(split=True), recipe_policies={"bf16": "golden"}).check("proj", Proj(), X)
    assert record.status == "pass" and record.policy == "golden"
    leaf = record.result.leaves[0]
    assert leaf.golden_dtype == "float64"
    assert 0 < leaf.worst_ratio[1] <= 1  # within the limits, but the target did differ
    assert leaf.mismatched > 0  # the informative allclose metrics still show the difference


@pytest.mark.parametrize("recipe, scale", [("fp32", 1 + 1e-4), ("bf16", 1 + 3e-2)])
def test_golden_fails_a_scaled_weight(recipe, scale):
    with pytest.raises(ParityError, match="golden policy") as info:
        case(recipe, target_patch(scale=scale), recipe_policies={recipe: "golden"}).check("proj", Proj(), X)
    leaf = info.value.result.leaves[0]
    assert leaf.over_limit  # at least one ratio above its limit
    assert leaf.golden_dtype == "float64"


def test_fp32_golden_catches_a_fault_allclose_misses():
    # A 3e-7 relative scale moves the output far below rtol=1e-5, yet far above the fp32 rounding error.
    patches = target_patch(scale=1 + 3e-6)
    assert case("fp32", patches).check("proj", Proj(), X).status == "pass"
    with pytest.raises(ParityError):
        case("fp32", patches, recipe_policies={"fp32": "golden"}).check("proj", Proj(), X)


def test_policy_precedence_default_recipe_check_marker_explicit():
    session = ParitySession(CPU, reference="cpu", recipe_policies={"bf16": "golden"},
                            check_policies={"attn_*": "golden rmse=3 # noisy fused kernel", "mlp": "allclose"})
    assert session.verdict_policy("fp32", "x") is None
    assert session.verdict_policy("bf16", "x") == G.default_golden_for_recipe("bf16")
    per_check = session.verdict_policy("fp32", "attn_self")
    assert per_check.rmse_ratio == 3 and per_check.source == "ini" and per_check.reason == "noisy fused kernel"
    assert per_check.small_value_threshold == 1e-6  # fp32 work keeps fp32's small-value thresholds
    assert session.verdict_policy("bf16", "mlp") is None
    assert session.verdict_policy("bf16", "mlp", marker="golden max_rel=20").source == "marker"
    assert session.verdict_policy("bf16", "mlp", marker="golden", explicit="allclose") is None
    explicit = session.verdict_policy("fp32", "x", explicit="golden mean_rel=4 # why")
    assert (explicit.mean_rel_ratio, explicit.source, explicit.reason) == (4, "check", "why")


@pytest.mark.parametrize("spec", ["goldne", "golden rtol=1e-3", "allclose rtol=1", "", "golden rmse=0.5"])
def test_bad_policy_specs_are_rejected_before_any_run(spec):
    with pytest.raises(ValueError):
        ParitySession(CPU, recipe_policies={"fp32": spec})
    session = ParitySession(CPU)
    with pytest.raises(ValueError):
        ParityCase(session, "t", "fp32", marker_policy=spec)


def test_golden_unavailable_falls_back_to_allclose_and_says_why():
    def hard_coded_float32(x: torch.Tensor) -> torch.Tensor:
        return (x * 2).to(torch.float32)

    record = case("fp32", recipe_policies={"fp32": "golden"}).check("f", hard_coded_float32, X)
    assert record.policy == "allclose" and record.status == "pass"
    assert "golden unavailable" in record.extra["policy_note"] and "float32" in record.extra["policy_note"]
    assert record.rows()[0]["policy_note"] == record.extra["policy_note"]


def test_golden_runs_once_per_test_check_and_input():
    calls = []

    class Counting(G.GoldenRunner):
        def run(self, fn, args=(), kwargs=None, **kw):
            if kw.get("dtype") is None:  # one call per golden (the dtype tries are internal)
                calls.append(1)
            return super().run(fn, args, kwargs, **kw)

    session = ParitySession(CPU, reference="cpu", recipe_policies={"fp32": "golden"}, golden_runner=Counting())
    module = Proj()
    ParityCase(session, "a", "fp32").check("proj", module, X)
    ParityCase(session, "a", "fp32").check("proj", module, X)  # the same test again (a repeated hypothesis example)
    assert len(calls) == 1
    # another test: its own golden (a class attribute or global the forward reads may differ; see memo_key)
    ParityCase(session, "b", "fp32").check("proj", module, X)
    ParityCase(session, "c", "fp32").check("proj", module, X * 2)
    assert len(calls) == 3


class TinyNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = Proj()
        self.head = torch.nn.Linear(64, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        return torch.nn.functional.mse_loss(self.head(torch.tanh(self.proj(x))).squeeze(-1), y)


def test_train_step_under_golden_passes_unchanged_and_fails_a_fault():
    y = torch.linspace(-1, 1, 32)
    inputs = {"x": X, "y": y}
    record = case("fp32", recipe_policies={"fp32": "golden"}).train_step("step", TinyNet(), inputs)
    assert record.policy == "golden" and record.status == "pass"
    assert {"loss", "grad.proj.w", "param.head.weight"} <= {leaf.path for leaf in record.result.leaves}
    assert {leaf.golden_dtype for leaf in record.result.leaves} == {"float64"}
    with pytest.raises(ParityError, match="golden policy"):
        case("fp32", target_patch(scale=1 + 1e-4), recipe_policies={"fp32": "golden"}).train_step(
            "step", TinyNet(), inputs)


def test_bf16_weights_train_step_trains_bf16_weights_and_fails_a_fault():
    # the step's module copy is cast as its inputs are: before, every bf16-weights step failed with a
    # RecipeUnsupportedError ("mat1 and mat2 must have the same dtype, but got BFloat16 and Float")
    try:
        torch.nn.functional.mse_loss(torch.ones(2, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.bfloat16))
    except RuntimeError:  # torch 2.5.1: "mse_cpu" not implemented for 'BFloat16' (the check says so, correctly)
        pytest.skip("this torch has no bf16 mse_loss on the CPU")
    y = torch.linspace(-1, 1, 32)
    inputs = {"x": X, "y": y}
    record = case("bf16-weights").train_step("step", TinyNet(), inputs)
    assert record.status == "pass"
    params = [leaf for leaf in record.result.leaves if leaf.path.startswith("param.")]
    assert params and {leaf.dtype for leaf in params} == {"bfloat16"}
    with pytest.raises(ParityError):
        case("bf16-weights", target_patch(scale=1 + 5e-2)).train_step("step", TinyNet(), inputs)


def test_compare_uses_a_given_golden_and_notes_a_missing_one():
    golden = torch.linspace(0, 1, 100, dtype=torch.float64)
    expected = golden.float() + 1e-7
    good, bad = golden.float() + 1.5e-7, golden.float() + 1e-5
    c = case("fp32", recipe_policies={"fp32": "golden"})
    assert c.compare("good", good, expected, golden=golden).policy == "golden"
    with pytest.raises(ParityError, match="golden policy"):
        c.compare("bad", bad, expected, golden=golden)
    record = c.compare("no_golden", good, expected)
    assert record.policy == "allclose" and "no golden=" in record.extra["policy_note"]


def test_training_mode_runs_get_fresh_buffers_but_share_the_weights():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).train()
    session = ParitySession(CPU, reference="cpu")
    first, second = session.place(module, CPU), session.place(module, CPU)
    assert first is not module and second is not first
    assert first[0].weight is module[0].weight  # no copy of the weights
    first(torch.randn(8, 4))
    assert not torch.equal(first[1].running_mean, module[1].running_mean)  # statistics moved in the copy only
    assert torch.equal(second[1].running_mean, module[1].running_mean)
    assert int(module[1].num_batches_tracked) == 0
    record = ParityCase(session, "t", "fp32").check("bn", module, torch.randn(8, 4))
    assert record.status == "pass" and int(module[1].num_batches_tracked) == 0


# --------------------------------------------------------------------------------------------
# golden verdict edge cases


class HandNorm(torch.nn.Module):
    """LayerNorm over the last dim; the target side computes it by hand (another legitimate kernel)."""

    by_hand = False
    eps = 1e-5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if HandNorm.by_hand:
            x = x.float()
            mean = x.mean(-1, keepdim=True)
            return (x - mean) / torch.sqrt(((x - mean) ** 2).mean(-1, keepdim=True) + HandNorm.eps)
        return torch.nn.functional.layer_norm(x, x.shape[-1:])


def hand_norm_with(eps: float):
    @contextlib.contextmanager
    def patches(device):
        HandNorm.by_hand, HandNorm.eps = True, eps
        try:
            yield
        finally:
            HandNorm.by_hand, HandNorm.eps = False, 1e-5
    return patches


hand_norm = hand_norm_with(1e-5)


def test_bf16_golden_passes_another_kernel_for_an_op_autocast_keeps_in_fp32():
    # The CPU reference of layer_norm under bf16 autocast is fp32 and equal to the fp32 golden; a
    # correct target kernel differs in last fp32 bits. The floor is the golden rounded to bf16.
    record = case("bf16", hand_norm, recipe_policies={"bf16": "golden"}).check("norm", HandNorm(), X)
    leaf = record.result.leaves[0]
    assert record.status == "pass" and leaf.dtype == "float32" and leaf.max_abs > 0
    with pytest.raises(ParityError):  # a real fault in the same op still fails: a wrong epsilon
        case("bf16", hand_norm_with(0.1), recipe_policies={"bf16": "golden"}).check("norm", HandNorm(), X)


def test_fp32_golden_fails_a_target_that_returns_bf16():
    class Down(torch.nn.Module):
        down = False

        def forward(self, x):
            y = x * 3
            return y.to(torch.bfloat16) if Down.down else y

    @contextlib.contextmanager
    def downcast(device):
        Down.down = True
        try:
            yield
        finally:
            Down.down = False

    with pytest.raises(ParityError, match="dtype mismatch: actual bfloat16 vs expected float32"):
        case("fp32", downcast, recipe_policies={"fp32": "golden"}).check("down", Down(), X)


def test_localization_is_not_run_under_the_golden_verdict():
    hook_calls = []
    session = ParitySession(CPU, reference="cpu", recipe_policies={"fp32": "golden"},
                            failure_hooks=[lambda *args: hook_calls.append(1) or "LOCALIZED"])
    with pytest.raises(ParityError) as info:
        ParityCase(session, "t", "fp32", patches=target_patch(scale=1 + 1e-4)).check("proj", Proj(), X)
    assert hook_calls == [] and "LOCALIZED" not in str(info.value)
    assert "not run under the golden verdict" in str(info.value)


def test_forget_drops_golden_copies_after_a_weight_edit():
    session = ParitySession(CPU, reference="cpu", recipe_policies={"fp32": "golden"})
    module = Proj()
    ParityCase(session, "a", "fp32").check("proj", module, X)
    with torch.no_grad():
        module.w.mul_(2)
    session.forget(module)
    with pytest.raises(ParityError, match="golden policy"):  # judged against the edited weights' golden
        ParityCase(session, "b", "fp32", patches=target_patch(scale=1 + 1e-5)).check("proj", module, X)


@pytest.mark.parametrize("policy", ["allclose", "golden"])
def test_same_check_name_on_different_closures_is_not_memoized_together(policy):
    session = ParitySession(CPU, reference="cpu", recipe_policies={"fp32": policy})
    for k in (2.0, 3.0):  # a parametrized test: same check name, same input, other closure
        record = ParityCase(session, f"t[{k}]", "fp32").check("scale", lambda x, k=k: x * k, X)
        assert record.status == "pass"


def test_any_exception_of_the_golden_run_falls_back_to_allclose():
    def no_fp64(x):
        if x.dtype == torch.float64:
            raise ValueError("no fp64 here")
        return x * 2

    record = case("fp32", recipe_policies={"fp32": "golden"}).check("f", no_fp64, X)
    assert record.policy == "allclose" and "ValueError: no fp64 here" in record.extra["policy_note"]


@pytest.mark.parametrize("policy, error", [("golden rmse=0.5", ValueError), (True, TypeError)])
def test_bad_policy_argument_names_the_check(policy, error):
    with pytest.raises(error, match=r"parity check 'proj': policy="):
        case("fp32").check("proj", Proj(), X, policy=policy)


def test_a_golden_policy_object_is_accepted_as_argument():
    record = case("fp32").check("proj", Proj(), X, policy=G.GoldenPolicy(rmse_ratio=3, source="check"))
    assert record.golden_policy.rmse_ratio == 3


def test_compare_refuses_a_golden_coarser_than_the_outputs():
    c = case("fp32", recipe_policies={"fp32": "golden"})
    with pytest.raises(ValueError, match="golden leaf '<output>' is bfloat16, coarser than the expected float32"):
        c.compare("x", X, X, golden=X.to(torch.bfloat16))


def test_torch_version_mismatch_note():
    from pytest_npu_parity.runner import torch_version_mismatch

    assert torch_version_mismatch(None) is None
    assert torch_version_mismatch({"torch": torch.__version__}) is None
    same_release = torch.__version__.split("+")[0] + "+cpu"
    assert torch_version_mismatch({"torch": same_release}) is None
    note = torch_version_mismatch({"torch": "1.13.0+cu117"})
    assert note.startswith("Note: torch-version mismatch — the baseline was recorded with torch 1.13.0+cu117, "
                           f"this run uses torch {torch.__version__}.")


def test_rounding_level_gradients_leave_their_parameters_out_of_a_train_step():
    from pytest_npu_parity.runner import rounding_level_params

    torch.manual_seed(0)
    # the bias before a training-mode BatchNorm: the loss does not depend on it, its gradient is noise
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 1))
    batch = {"input": torch.randn(8, 4)}
    # with optimizer replay (the default) the bias is compared with the step from the target's gradients
    record = case("fp32").train_step("step", net, batch, loss_fn=lambda out: out.pow(2).mean())
    assert "optimizer replay" in record.extra.get("policy_note", "")
    assert {"grad.0.bias", "param.0.bias"} <= {row["leaf"] for row in record.rows()}
    # without it (an optimizer the replay cannot reproduce) the bias after the step is left out
    calls = []

    def not_replayable(params):
        calls.append(1)
        return torch.optim.AdamW(params, lr=1e-4 * (1 + (len(calls) > 2)))
    record = case("fp32").train_step("step", net, batch, loss_fn=lambda out: out.pow(2).mean(),
                                     optimizer=not_replayable)
    note = record.extra.get("policy_note", "")
    assert "optimizer replay not used" in note
    assert "1 parameter(s) after the step not compared (param.0.bias)" in note
    leaves = {row["leaf"] for row in record.rows()}
    assert "grad.0.bias" in leaves and "param.0.bias" not in leaves and "param.0.weight" in leaves
    assert rounding_level_params({"grad.a": torch.tensor([1.0, -2.0]), "param.a": torch.zeros(2),
                                  "grad.b": torch.tensor([1e-12]), "param.b": torch.zeros(1)}) == {"param.b"}
    assert rounding_level_params({"grad.a": torch.tensor([1.0]), "param.a": torch.zeros(1),
                                  "grad.b": torch.tensor([1e-3]), "param.b": torch.zeros(1)}) == set()


def test_stale_suites_needs_most_checks_of_a_model_stale_for_one_cause():
    from pytest_npu_parity.runner import stale_suites

    def row(test, cause=None, weights="ab12", reference="baseline"):
        return {"test_id": f"parity_suites/demo/test_m.py::{test}", "check": test, "recipe": "fp32",
                "reference": reference, "weights": weights,
                **({"baseline_error": "stale", "stale_cause": cause} if cause else {})}

    found = stale_suites([row("a", "weights"), row("b", "weights+input"), row("f", "input", weights=None),
                          row("tiny")])  # a second model whose baseline still matches
    assert [(s.suite, s.directory, s.cause, len(s.checks), s.fresh) for s in found] == [
        ("demo", "parity_suites/demo", "weights", 3, 1)]
    assert found[0].fix("pytest --update-baselines") == "pytest --update-baselines parity_suites/demo"
    assert stale_suites([row("a", "weights"), row("b", "input")]) == []  # no shared cause
    assert stale_suites([row("a", "weights"), row("b", "weights"), row("c"), row("d")]) == []  # half fresh
    assert stale_suites([row("a", "weights")]) == []  # one stale check is not suite-wide
    assert stale_suites([row("a", "other"), row("b", "other")]) == []  # a leaf or dtype, not the model


# --------------------------------------------------------------------------------------------
# The fp16 recipe: autocast fp16, training steps through a dynamic GradScaler


class OverflowNet(torch.nn.Module):
    """A linear layer whose fp16 backward overflows at the scaler's first scale (2^16) and not at the
    next (2^15): the loss ``1.5 · Σ y`` of one sample sends ``1.5 · scale`` into the fp16 output's
    gradient (and its bias gradient), 98304 > 65504 (fp16's largest value) at 2^16, 49152 at 2^15."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(4)
        self.lin = torch.nn.Linear(8, 4)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(4, 8, generator=g) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 1.5 * self.lin(x).float().sum()


SMALL_X = torch.rand(1, 8, generator=torch.Generator().manual_seed(5)) / 100


def test_fp16_train_step_backs_off_an_overflowing_scale_and_compares_the_amp_leaves():
    fp16 = case("fp16")
    assert fp16.recipe.loss_scaling
    record = fp16.train_step("step", OverflowNet(), {"x": SMALL_X}, loss_fn=lambda out: out, max_grad_norm=None)
    assert record.status == "pass" and record.policy == "golden" and record.golden_policy.allclose_floor
    assert {"loss", "grad.lin.weight", "param.lin.weight", "amp.scale", "amp.skipped_steps",
            "amp.grad_norm"} <= {leaf.path for leaf in record.result.leaves}
    reference = next(iter(fp16.session._reference_memo.values()))[1]
    assert float(reference["amp.scale"]) == 2.0 ** 15 and int(reference["amp.skipped_steps"]) == 1
    # the unscaled gradients are the exact ones: d(1.5 Σ (x W^T + b))/dW = 1.5 x per row, /db = 1.5
    exact = 1.5 * SMALL_X.expand(4, 8)
    torch.testing.assert_close(reference["grad.lin.weight"], exact, rtol=1e-3, atol=0)
    assert torch.equal(reference["grad.lin.bias"], torch.full((4,), 1.5))
    norm = float(torch.cat([exact.flatten(), torch.full((4,), 1.5)]).norm())
    assert float(reference["amp.grad_norm"]) == pytest.approx(norm, rel=1e-3)


def _fp16_fault(fault_name, policy=None):
    from loss_scale_faults import FAULTS, target_scaler

    return case("fp16", target_scaler(FAULTS[fault_name]), **({"recipe_policies": {"fp16": policy}} if policy else {}))


def _failing(info):
    return {leaf.path for leaf in info.value.result.leaves if not leaf.passed}


def test_fp16_train_step_fails_a_scaler_that_unscales_with_a_stale_scale():
    with pytest.raises(ParityError, match=r"(?s)output .amp\.grad_norm.*expected 3\.0005") as info:
        _fp16_fault("stale_inverse_scale", "allclose").train_step("step", OverflowNet(), {"x": SMALL_X},
                                                                  loss_fn=lambda out: out, max_grad_norm=None)
    assert "grad.lin.weight" in str(info.value) and "grad.lin.bias" in str(info.value)  # halved
    with pytest.raises(ParityError) as info:  # the default, the golden floor
        _fp16_fault("stale_inverse_scale").train_step("step", OverflowNet(), {"x": SMALL_X}, loss_fn=lambda out: out,
                                                      max_grad_norm=None)
    assert {"grad.lin.weight", "grad.lin.bias", "amp.grad_norm"} <= _failing(info)


def test_fp16_train_step_sees_a_stale_scale_behind_gradient_clipping():
    # The global norm (3.0) is above max_grad_norm: clipping rescales both sides' gradients to norm 1,
    # so halved gradients look right afterwards; amp.grad_norm (before clipping) still differs.
    kwargs = dict(loss_fn=lambda out: out, max_grad_norm=1.0)
    assert case("fp16").train_step("step", OverflowNet(), {"x": SMALL_X}, **kwargs).status == "pass"
    with pytest.raises(ParityError) as info:
        _fp16_fault("stale_inverse_scale").train_step("step", OverflowNet(), {"x": SMALL_X}, **kwargs)
    failing = [leaf.path for leaf in info.value.result.leaves if not leaf.passed]
    assert failing == ["amp.grad_norm"]


def test_fp16_train_step_fails_a_scaler_that_misses_an_overflow():
    with pytest.raises(ParityError) as info:
        _fp16_fault("missed_overflow", "allclose").train_step("step", OverflowNet(), {"x": SMALL_X},
                                                              loss_fn=lambda out: out, max_grad_norm=None)
    text = str(info.value)
    assert "amp.skipped_steps" in text and "amp.scale" in text
    # the default, the golden floor: the (float32) golden step overflows nowhere (scale 2^16, as the faulty target's),
    # so amp.scale would pass a ratio test against it: it is compared exactly, as the skipped steps (an integer leaf)
    with pytest.raises(ParityError) as info:
        _fp16_fault("missed_overflow").train_step("step", OverflowNet(), {"x": SMALL_X}, loss_fn=lambda out: out,
                                                  max_grad_norm=None)
    assert {"amp.scale", "amp.skipped_steps", "amp.grad_norm", "grad.lin.weight"} <= _failing(info)


def test_fp16_eval_check_runs_in_fp16_and_fails_a_scaled_weight():
    record = case("fp16").check("proj", Proj(), X)
    assert record.status == "pass" and {leaf.dtype for leaf in record.result.leaves} == {"float16"}
    with pytest.raises(ParityError):
        case("fp16", target_patch(scale=1 + 1e-2)).check("proj", Proj(), X)


def test_fp16_train_step_under_golden_runs_the_scaler_in_its_golden_too():
    # The golden step (float32, no autocast) goes through the same scaler: no overflow there (scale 2^16,
    # nothing skipped); both sides are 2^15 off in amp.scale, which is compared exactly between them instead.
    kwargs = dict(loss_fn=lambda out: out, max_grad_norm=None)
    record = case("fp16", recipe_policies={"fp16": "golden"}).train_step("step", OverflowNet(), {"x": SMALL_X}, **kwargs)
    # no note of a golden that could not run; the parameters are judged against the optimizer replay
    assert record.status == "pass" and record.policy == "golden"
    assert record.extra.get("policy_note", "").startswith("param.* after the step compared with the CPU optimizer's step")
    scale = next(leaf for leaf in record.result.leaves if leaf.path == "amp.scale")
    assert scale.exact and scale.passed
    from loss_scale_faults import FAULTS, target_scaler

    with pytest.raises(ParityError) as info:
        case("fp16", target_scaler(FAULTS["stale_inverse_scale"]), recipe_policies={"fp16": "golden"}).train_step(
            "step", OverflowNet(), {"x": SMALL_X}, **kwargs)
    assert "amp.grad_norm" in {leaf.path for leaf in info.value.result.leaves if not leaf.passed}
    with pytest.raises(ParityError) as info:  # 2^16 where the reference backed off to 2^15: the golden's own scale
        case("fp16", target_scaler(FAULTS["missed_overflow"]), recipe_policies={"fp16": "golden"}).train_step(
            "step", OverflowNet(), {"x": SMALL_X}, **kwargs)
    assert {"amp.scale", "amp.skipped_steps"} <= _failing(info)


def test_fp16_train_steps_golden_runs_once_in_float32(monkeypatch):
    # its amp.* leaves are float32 (the scaler's state): a float64 golden step was run, refused, then run again
    from pytest_npu_parity.runtime.golden_run import GoldenRunner

    tried: list[torch.dtype] = []
    run = GoldenRunner.run

    def spy(self, fn, args=(), kwargs=None, **options):
        tried.append(options.get("dtype"))
        return run(self, fn, args, kwargs, **options)

    monkeypatch.setattr(GoldenRunner, "run", spy)
    kwargs = dict(loss_fn=lambda out: out, max_grad_norm=None)
    record = case("fp16", recipe_policies={"fp16": "golden"}).train_step("step", OverflowNet(), {"x": SMALL_X}, **kwargs)
    assert record.status == "pass" and tried == [torch.float32]
    tried.clear()  # bf16's step has no amp.* leaves: its golden tries float64 first
    case("bf16", recipe_policies={"bf16": "golden"}).train_step("step", OverflowNet(), {"x": SMALL_X}, **kwargs)
    assert tried[0] == torch.float64


# ---------------------------------------------------------------------------------------------
# Audit modes and budgets, recipe errors, run metadata
# ---------------------------------------------------------------------------------------------

class HostOnes(torch.nn.Module):
    """Adds a constant built without ``device=``: a mixed-device op (and a CPU op) on a target."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) + torch.ones(4)


def audit_case(mode, recipe="fp32", **case_kwargs) -> ParityCase:
    from pytest_npu_parity.runner import target_audit

    session = ParitySession(CPU, reference="cpu", audit_factory=target_audit, audit_mode=mode)
    return ParityCase(session, "tests/test_runner.py::audited", recipe, **case_kwargs)


def test_audit_mode_fail_fails_a_check_whose_numbers_pass():
    torch.manual_seed(0)
    with pytest.raises(ParityError, match="with every output leaf within tolerance") as info:
        audit_case("fail").check("ones", HostOnes(), torch.randn(3, 4))
    text = str(info.value)
    assert "mixed-device op aten::add.Tensor: cuda:1 + cpu float32 at" in text
    assert "return self.lin(x) + torch.ones(4)" in text and "audit_budget={'mixed_device': 1, 'cpu_fallback': 1}" in text
    # the same check under record mode (the engine's default with an audit factory) judges nothing
    record = audit_case(None).check("ones", HostOnes(), torch.randn(3, 4))
    assert record.status == "pass" and record.audit["counts"]["mixed_device"] == 1
    assert "audit_problem" not in record.extra


def test_audit_mode_warn_keeps_the_verdict_and_warns_at_the_models_line():
    from pytest_npu_parity.audit import ParityAuditWarning

    torch.manual_seed(0)
    with pytest.warns(ParityAuditWarning, match="mixed-device op aten::add.Tensor") as caught:
        record = audit_case("warn").check("ones", HostOnes(), torch.randn(3, 4))
    assert record.status == "pass"
    assert caught[0].filename == __file__ and "torch.ones(4)" in open(__file__).read().splitlines()[caught[0].lineno - 1]
    row = record.rows()[0]
    assert row["verdict"] == "pass" and "aten::add.Tensor" in row["audit_problem"] and row["audit_verdict"] == "warn"
    assert row["audit_budget"] == "mixed_device 0, h2d 0, d2h 0, host_sync any, cpu_fallback 0, fp64 0"


def test_audit_budgets_of_test_and_check_allow_declared_events():
    torch.manual_seed(0)
    case = audit_case("fail", audit_budget={"cpu_fallback": 1})
    with pytest.raises(ParityError, match=r"mixed_device 1 \(allowed 0\)"):
        case.check("ones", HostOnes(), torch.randn(3, 4))
    record = case.check("ones_allowed", HostOnes(), torch.randn(3, 4), audit_budget="mixed_device=1 # known constant")
    assert record.status == "pass" and record.extra["audit_budget"].endswith("# known constant")
    with pytest.raises(ValueError, match="parity check 'bad': audit budget"):
        case.check("bad", HostOnes(), torch.randn(3, 4), audit_budget={"mixed": 1})
    off = audit_case("fail", audit_mode="off").check("ones", HostOnes(), torch.randn(3, 4))
    assert off.audit is None and off.status == "pass"


def test_a_clean_training_step_with_dropout_has_no_audit_events():
    """Dropout masks (the shared random stream), gradient clipping and the optimizer step are the
    plugin's: the audited training step of a clean model records nothing."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.2), torch.nn.TransformerEncoder(layer, 1))
    record = audit_case("fail").train_step("step", model, {"input": torch.randn(2, 5, 16)},
                                           loss_fn=lambda out: out.square().mean())
    assert record.status == "pass"
    assert record.audit["events"] == [], record.audit


def test_an_op_the_recipe_breaks_is_one_sentence_with_the_backend_error_as_cause():
    class Spectrum(torch.nn.Module):
        def forward(self, x):
            return torch.fft.rfft(x).abs()  # bfloat16 has no FFT on the CPU

    with pytest.raises(RuntimeError) as info:
        case("bf16-weights").check("spectrum", Spectrum(), torch.randn(2, 16))
    from pytest_npu_parity.recipes import RecipeUnsupportedError

    error = info.value
    assert isinstance(error, RecipeUnsupportedError), error
    text = str(error)
    assert text.count(". ") == 0 and text.endswith("--parity-dtypes fp32.")  # one sentence
    assert "`return torch.fft.rfft(x).abs()` in Spectrum" in text and "under recipe bf16-weights" in text and "recipes=[\"fp32\"]" in text
    assert "Unsupported dtype BFloat16" in text and "test_runner.py:" in text
    assert "Unsupported dtype BFloat16" in str(error.__cause__)
    assert case("fp32").check("spectrum", Spectrum(), torch.randn(2, 16)).status == "pass"


class Spectral(torch.nn.Module):
    """Doubles its input; under ``Spectral.fft`` (the target's patch set) through an FFT, which has no
    bfloat16 kernel on the CPU."""

    fft = False

    def forward(self, x):
        if Spectral.fft:
            return torch.fft.irfft(torch.fft.rfft(x * 2), n=x.shape[-1])
        return x * 2


@contextlib.contextmanager
def _fft_patches(device):
    Spectral.fft = True
    try:
        yield
    finally:
        Spectral.fft = False


def test_a_target_that_cannot_run_what_the_reference_runs_under_the_recipe_is_named_as_the_gap():
    with pytest.raises(RuntimeError) as info:
        case("bf16-weights", patches=_fft_patches).check("spectral", Spectral(), torch.randn(2, 16))
    from pytest_npu_parity.recipes import RecipeUnsupportedError

    error = info.value
    assert isinstance(error, RecipeUnsupportedError) and error.reference_runs
    text = str(error)
    assert "with the patch set, though the reference (no patch set, on the CPU) runs it under bf16-weights" in text
    assert "a gap of the target's kernel or of the patch set, not of the model" in text
    assert text.count(". ") == 0 and "Unsupported dtype BFloat16" in text
    assert case("fp32", patches=_fft_patches).check("spectral", Spectral(), torch.randn(2, 16)).status == "pass"


def test_an_error_under_fp32_too_is_not_blamed_on_the_recipe():
    class Broken(torch.nn.Module):
        def forward(self, x):
            return x @ torch.ones(3, 3)  # a shape bug: fails under every recipe

    with pytest.raises(RuntimeError, match="cannot be multiplied") as info:
        case("bf16").check("broken", Broken(), torch.randn(2, 4))
    from pytest_npu_parity.recipes import RecipeUnsupportedError

    assert not isinstance(info.value, RecipeUnsupportedError)


def test_lstm_and_gru_run_under_bf16_on_this_cpu():
    """nn.LSTM/GRU under CPU bf16 autocast: measured to run on torch 2.5.1 and 2.14.1 (x86 with
    AVX512-BF16/AMX), eval and training, so no recipe error may be raised for them. Where oneDNN has no
    bf16 RNN (no AVX-512, or ONEDNN_MAX_CPU_ISA=AVX2: tests/cpu_features.py) torch raises for the LSTM, and
    the check says so in one sentence naming the op and the fix; the GRU runs there too."""
    from cpu_features import runs_bf16_lstm
    from pytest_npu_parity.recipes import RecipeUnsupportedError

    torch.manual_seed(0)
    lstm, gru = torch.nn.LSTM(8, 16, batch_first=True), torch.nn.GRU(8, 16, num_layers=2, batch_first=True)
    if runs_bf16_lstm():
        assert case("bf16").check("rnn", lstm.eval(), torch.randn(2, 5, 8)).status == "pass"
    else:
        with pytest.raises(RecipeUnsupportedError, match=r"aten::mkldnn_rnn_layer in LSTM .* cannot run on cpu "
                           r"under recipe bf16 .*primitive descriptor for the LSTM.*recipes=\[.fp32.\]"):
            case("bf16").check("rnn", lstm.eval(), torch.randn(2, 5, 8))
    assert case("bf16").check("rnn", gru.eval(), torch.randn(2, 5, 8)).status == "pass"


def test_masked_transformer_encoder_under_bf16_says_which_op_and_how_to_restrict():
    """nn.TransformerEncoder with a src_key_padding_mask takes the nested-tensor fast path in eval:
    under CPU bf16 autocast torch 2.14.1 raises "expected scalar type Float but found BFloat16"
    there; torch 2.5.1 runs it through the recipe's encoder shim (recipes module docstring)."""
    from pytest_npu_parity.recipes import RecipeUnsupportedError, cpu_autocast_breaks_encoder_fast_path

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, 2).eval()
    x = torch.randn(2, 5, 16)
    mask = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    assert case("fp32").check("enc", encoder, x, src_key_padding_mask=mask).status == "pass"
    try:
        record = case("bf16").check("enc", encoder, x, src_key_padding_mask=mask)
    except RecipeUnsupportedError as exc:
        assert not cpu_autocast_breaks_encoder_fast_path()  # the torch releases without the shim
        assert "torch._transformer_encoder_layer_fwd in layers.0 (TransformerEncoderLayer)" in str(exc)
        assert "under recipe bf16" in str(exc) and "expected scalar type Float but found BFloat16" in str(exc)
    else:
        assert record.status == "pass" and cpu_autocast_breaks_encoder_fast_path()


def test_metadata_names_a_patch_factory_that_names_no_patches_and_the_threads():
    @contextlib.contextmanager
    def my_patches(device):
        yield  # names no patches (no .applied)

    c = case("fp32", patches=my_patches)
    c.check("proj", Proj(), X)
    meta = c.session.metadata(["fp32"])
    assert meta["patch_set"] == ["test_runner.test_metadata_names_a_patch_factory_that_names_no_patches_and_the_threads.my_patches"]
    assert meta["threads"] == torch.get_num_threads() and meta["interop_threads"] == torch.get_num_interop_threads()
    assert case("fp32").session.metadata(["fp32"])["patch_set"] == []


def test_thread_count_mismatch_note():
    from pytest_npu_parity.runner import thread_count_mismatch

    n = torch.get_num_threads()
    note = thread_count_mismatch({"device_type": "cpu", "threads": n + 1}, CPU)
    assert note and f"recorded with {n + 1} intra-op threads, this run uses {n}" in note
    assert thread_count_mismatch({"device_type": "cpu", "threads": n}, CPU) is None
    assert thread_count_mismatch({"device_type": "cpu"}, CPU) is None  # older baselines record no count
    assert thread_count_mismatch({"device_type": "cuda", "threads": n + 1}, CPU) is None


# your own model: train-step inputs and labels, keyword inputs, configuration staleness


class Classifier(torch.nn.Module):
    """``head(tanh(proj(x)))`` logits for 3 classes; ``forward(x)`` takes one positional tensor."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = Proj()
        self.head = torch.nn.Linear(64, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.proj(x)))


LABELS = torch.arange(32) % 3


def test_train_step_takes_positional_inputs_and_labels_for_loss_fn():
    c = case("fp32")
    record = c.train_step("step", Classifier(), X, labels=LABELS, loss_fn=torch.nn.CrossEntropyLoss())
    assert record.status == "pass" and record.golden_policy.allclose_floor  # fp32 training default
    assert "golden unavailable" not in record.extra.get("policy_note", "")
    leaves = {leaf.path: leaf for leaf in record.result.leaves}
    assert {"loss", "grad.proj.w", "grad.head.weight", "param.head.bias"} <= set(leaves)
    # the loss is loss_fn(output, labels): the same number as a hand-written step
    model = Classifier()
    expected = torch.nn.functional.cross_entropy(model(X), LABELS)
    assert c.session.records[-1].result.leaves[0].path == "loss"
    tuple_record = case("fp32").train_step("step", Classifier(), (X,), labels=LABELS,
                                           loss_fn=torch.nn.CrossEntropyLoss())
    assert [leaf.path for leaf in tuple_record.result.leaves] == list(leaves)
    dict_record = case("fp32").train_step("step", Classifier(), {"x": X}, labels=LABELS,
                                          loss_fn=lambda out, y: torch.nn.functional.cross_entropy(out, y))
    assert dict_record.status == "pass"
    session = ParitySession(CPU, reference="cpu")
    run = ParityCase(session, "t", "fp32")
    run.train_step("step", Classifier(), X, labels=LABELS, loss_fn=torch.nn.CrossEntropyLoss())
    reference = session._reference_memo[next(iter(session._reference_memo))][1]
    assert torch.equal(reference["loss"], expected.detach())


def test_a_fault_fails_a_train_step_with_labels():
    # under the golden floor a 1e-4 weight scale stays within fp32's atol here (gradients ~1e-3, AdamW
    # updates ±lr); 1e-2 does not
    with pytest.raises(ParityError, match="Parity check 'step' failed"):
        case("fp32", target_patch(scale=1 + 1e-2)).train_step("step", Classifier(), X, labels=LABELS,
                                                                loss_fn=torch.nn.CrossEntropyLoss())


def test_a_weighted_loss_module_follows_each_side_and_the_golden():
    weight = torch.tensor([1.0, 2.0, 0.5])
    record = case("fp32", recipe_policies={"fp32": "golden"}).train_step(
        "step", Classifier(), X, labels=LABELS, loss_fn=torch.nn.CrossEntropyLoss(weight=weight))
    assert record.policy == "golden" and {leaf.golden_dtype for leaf in record.result.leaves} == {"float64"}
    assert record.status == "pass"


def test_labels_need_a_loss_fn():
    with pytest.raises(ValueError, match=r"train_step 'step': labels= needs a loss_fn\(output, labels\)"):
        case("fp32").train_step("step", Classifier(), X, labels=LABELS)
    with pytest.raises(ValueError, match="no scalar loss.*labels=.*loss_fn=torch.nn.CrossEntropyLoss"):
        case("fp32").train_step("step", Classifier(), X)


def test_labels_are_part_of_the_inputs_fingerprint(tmp_path):
    from pytest_npu_parity.baselines import StaleBaselineError, SuiteStores

    test_id = "parity_suites/demo/test_m.py::t[fp32]"
    store = SuiteStores(tmp_path)
    recording = ParityCase(ParitySession(CPU, update_baselines=True, store=store), test_id, "fp32")
    recording.train_step("step", Classifier(), X, labels=LABELS, loss_fn=torch.nn.CrossEntropyLoss())
    assert recording.finish() == "created"
    ParityCase(ParitySession(CPU, store=store), test_id, "fp32").train_step(
        "step", Classifier(), X, labels=LABELS, loss_fn=torch.nn.CrossEntropyLoss())
    with pytest.raises(StaleBaselineError, match="input hash changed") as info:
        ParityCase(ParitySession(CPU, store=store), test_id, "fp32").train_step(
            "step", Classifier(), X, labels=LABELS.flip(0), loss_fn=torch.nn.CrossEntropyLoss())
    assert info.value.stale_cause == "input"


def test_a_train_steps_optimizer_clipping_and_loss_are_part_of_its_baseline(tmp_path):
    from pytest_npu_parity.baselines import StaleBaselineError, SuiteStores

    test_id = "parity_suites/demo/test_m.py::t[fp32]"
    store = SuiteStores(tmp_path)

    def step(**kwargs):
        return ParityCase(ParitySession(CPU, store=store), test_id, "fp32").train_step("step", Classifier(), X, **kwargs)

    onehot = torch.nn.functional.one_hot(LABELS, 3).float()  # MSELoss/L1Loss targets of the (32, 3) logits
    recording = ParityCase(ParitySession(CPU, update_baselines=True, store=store), test_id, "fp32")
    recording.train_step("step", Classifier(), X, labels=onehot, loss_fn=torch.nn.MSELoss())
    assert recording.finish() == "created"
    recorded = store.load(test_id).checks["step"].meta["train_recipe"]
    assert recorded["optimizer"] == "AdamW" and recorded["optimizer.lr"] == 1e-4 and recorded["loss"] == "MSELoss"
    same = step(labels=onehot, loss_fn=torch.nn.MSELoss())  # the same recipe: fresh, and it passes
    assert same.status == "pass" and same.reference == "baseline"
    cases = [
        (dict(optimizer=lambda p: torch.optim.SGD(p, lr=0.01)), "optimizer AdamW → SGD, lr 0.0001 → 0.01"),
        (dict(optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)),
         "train recipe changed: lr 0.0001 → 0.001"),
        (dict(loss_fn=torch.nn.L1Loss()), "train recipe changed: loss MSELoss → L1Loss"),
        (dict(loss_fn=torch.nn.MSELoss(), max_grad_norm=None), "train recipe changed: max_grad_norm 1.0 → None"),
    ]
    for kwargs, message in cases:
        with pytest.raises(StaleBaselineError, match="is stale for check 'step'") as info:
            step(**{"labels": onehot, "loss_fn": torch.nn.MSELoss(), **kwargs})
        assert message in str(info.value) and "optimizer replay" not in str(info.value)
        assert info.value.stale_cause == "other"  # not the weights, config or input


def test_a_train_step_baseline_recorded_without_a_recipe_makes_no_claim(tmp_path):
    from pytest_npu_parity.baselines import SuiteStores

    test_id = "parity_suites/demo/test_m.py::t[fp32]"
    store = SuiteStores(tmp_path)
    recording = ParityCase(ParitySession(CPU, update_baselines=True, store=store), test_id, "fp32")
    recording.train_step("step", Classifier(), X, labels=LABELS, loss_fn=torch.nn.CrossEntropyLoss())
    recording._pending["step"].meta.pop("train_recipe")  # as written before the field existed
    assert recording.finish() == "created"
    # compared with the AdamW reference all the same (nothing recorded to say otherwise)
    record = ParityCase(ParitySession(CPU, store=store), test_id, "fp32").train_step(
        "step", Classifier(), X, labels=LABELS, loss_fn=torch.nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1))
    assert record.status == "pass" and record.reference == "baseline"


def test_a_train_step_with_positional_inputs_is_self_checked_and_localized():
    from pytest_npu_parity.localize import Localizer
    from pytest_npu_parity.selfcheck import SelfCheck

    record = case("fp32", check_hooks=[SelfCheck(weight_rtols=1000)]).train_step(
        "step", Classifier(), X, labels=LABELS, loss_fn=torch.nn.CrossEntropyLoss())
    assert record.extra["teeth"] is True
    assert record.extra["selfcheck"]["input_sensitive"] is True  # the positional input was perturbed
    with pytest.raises(ParityError) as info:
        case("fp32", target_patch(scale=1 + 1e-3), failure_hooks=[Localizer(budget_s=60)],
             recipe_policies={"fp32": "allclose"}).train_step(
            "step", Classifier(), X, labels=LABELS, loss_fn=torch.nn.CrossEntropyLoss())
    assert "First divergence: proj (Proj)" in str(info.value) and "could not run" not in str(info.value)


class KeywordModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(16, 8)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict:
        h = self.norm(self.embed(input_ids)) * attention_mask[..., None]
        return {"last_hidden_state": h, "pooled": h.sum(1)}


def test_a_forward_with_keyword_inputs_is_checked_and_its_config_change_is_stale(tmp_path):
    from pytest_npu_parity.baselines import StaleBaselineError, SuiteStores

    ids = torch.arange(12).reshape(2, 6) % 16
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    record = case("fp32").check("kw", KeywordModel(), input_ids=ids, attention_mask=mask)
    assert [leaf.path for leaf in record.result.leaves] == ["last_hidden_state", "pooled"]

    test_id = "parity_suites/demo/test_m.py::t[fp32]"
    store = SuiteStores(tmp_path)
    recording = ParityCase(ParitySession(CPU, update_baselines=True, store=store), test_id, "fp32")
    recording.check("kw", KeywordModel().eval(), input_ids=ids, attention_mask=mask)
    recording.finish()
    changed = KeywordModel().eval()
    changed.norm.eps = 1e-3
    with pytest.raises(StaleBaselineError) as info:
        ParityCase(ParitySession(CPU, store=store), test_id, "fp32").check(
            "kw", changed, input_ids=ids, attention_mask=mask)
    assert "structure changed (1 of 3 modules differ, e.g. 'norm': eps 1e-05 → 0.001)" in str(info.value)
    assert info.value.stale_cause == "config"
    changed.norm.eps = 1e-5
    changed.train()  # the mode is part of a check's structure
    with pytest.raises(StaleBaselineError, match="'<KeywordModel>': eval → train mode"):
        ParityCase(ParitySession(CPU, store=store), test_id, "fp32").check(
            "kw", changed, input_ids=ids, attention_mask=mask)


def test_stale_cause_names_the_config_and_suites_share_it():
    from pytest_npu_parity.runner import stale_cause, stale_suites

    meta = {"config_hash": "w", "input_hash": "i"}
    assert stale_cause(meta, {"config_hash": "w", "input_hash": "i"}, True) == "config"
    assert stale_cause(meta, {"config_hash": "w", "input_hash": "j"}, True) == "config+input"
    assert stale_cause(meta, {"config_hash": "v", "input_hash": "j"}, False) == "weights+input"

    def row(test, cause):
        return {"test_id": f"parity_suites/demo/test_m.py::{test}", "check": test, "recipe": "fp32",
                "reference": "baseline", "weights": "ab12", "baseline_error": "stale", "stale_cause": cause}

    (suite,) = stale_suites([row("model", "config"), row("layer", "config+input")])
    assert suite.cause == "config"


def _switched(cls: type, switch: str):
    """A patch set that sets the class switch ``cls.<switch>`` on the target side only."""
    return switched(cls, switch, True)


class Spike(torch.nn.Module):
    """``x @ w``; with ``Spike.spike`` set (the target's patch set), one output element is off by 1000
    (a kernel that writes one wrong element, e.g. at a tile's edge)."""

    spike = False

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(256, 64, generator=torch.Generator().manual_seed(0)) / 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.w
        if Spike.spike:
            y = y.clone()
            y.view(-1)[0] += 1000.0
        return y


_spike = _switched(Spike, "spike")


def test_allclose_floor_does_not_pass_an_element_the_budget_would_excuse():
    # bf16 (default policy golden floor): 2,048 output elements, budget 1e-3 lets 2 fall outside the allclose
    # bound; one element 1000 off must be judged by the ratio test, which fails it
    with pytest.raises(ParityError, match="golden policy") as info:
        case("bf16", _spike).check("spike", Spike(), X)
    assert "rmse" in str(info.value)
    # the allclose verdict's built-in budget holds the element to 100x the bound too (tolerance.budget_takes)...
    with pytest.raises(ParityError, match=r"each within 100x the bound: the worst is .*x outside it"):
        case("bf16", _spike, recipe_policies={"bf16": "allclose"}).check("spike", Spike(), X)
    # also under an rtol of the user's (the budget is still the built-in one)...
    with pytest.raises(ParityError, match=r"each within 100x the bound"):
        case("bf16", _spike, recipe_policies={"bf16": "allclose"}).check("spike", Spike(), X, rtol=2e-3, reason="r")
    # ...while a budget the user sets takes any amount, as torch_npu's assertRtolEqual does
    assert case("bf16", _spike, recipe_policies={"bf16": "allclose"}).check(
        "spike", Spike(), X, budget=1e-3, reason="one known outlier").status == "pass"
    # and an untouched target passes the floor
    assert case("bf16").check("spike", Spike(), X).status == "pass"


class Edited(torch.nn.Module):
    """``x @ w``; with ``Edited.fault`` set (the target's patch set) a batch of 8 rows is computed with the
    weight × 1.02 (a fault that the first check, on 4 rows, does not reach)."""

    fault = False

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(256, 64, generator=torch.Generator().manual_seed(0)) / 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.w * 1.02 if Edited.fault and x.shape[0] == 8 else self.w
        return x @ w


_edited_fault = _switched(Edited, "fault")


def _load_new_weights(module: torch.nn.Module) -> None:
    with torch.no_grad():  # e.g. a checkpoint loaded into the checked model
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)) / 16)


def test_a_module_edited_between_checks_is_judged_by_a_golden_of_its_new_weights():
    # bf16 (golden floor): the first check caches the float64 golden copy; the weights change; the second
    # check's fault must be judged against the new weights' golden, not the old one's (a false pass before)
    c = ParityCase(ParitySession(CPU, reference="cpu"), "tests/test_runner.py::t", "bf16", patches=_edited_fault)
    model = Edited().eval()
    assert c.check("before", model, X[:4]).status == "pass"
    _load_new_weights(model)
    with pytest.raises(ParityError, match="golden policy"):
        c.check("after", model, X[:8])


def test_a_module_edited_between_checks_gets_fresh_dtype_and_golden_copies():
    session = ParitySession(CPU, reference="cpu")
    c = ParityCase(session, "tests/test_runner.py::t", "bf16")
    model = Edited().eval()
    c.check("before", model, X[:4])
    old = session.place(model, CPU, torch.bfloat16)
    assert session.golden_runner._copy(model, torch.float64) is session.golden_runner._copy(model, torch.float64)
    _load_new_weights(model)
    c.check("after", model, X[:4])
    assert torch.equal(session.place(model, CPU, torch.bfloat16).w, model.w.detach().to(torch.bfloat16))
    assert not torch.equal(old.w, model.w.detach().to(torch.bfloat16))
    assert torch.equal(session.golden_runner._copy(model, torch.float64).w, model.w.detach().double())
    # an attribute the module's fingerprints record counts too; the training mode alone does not
    kept = session.place(model, CPU, torch.bfloat16)
    model.train()
    assert not session.note_state(model, check_hashes(model, (X[:4],), {}))
    model.eval()
    assert session.place(model, CPU, torch.bfloat16) is kept
    model._scale = 2.0
    c.check("attribute", model, X[:4])
    assert session.place(model, CPU, torch.bfloat16) is not kept


class SplitNet(torch.nn.Module):
    """Two linears; with ``SplitNet.split`` (the target) the first one is computed as two half-K products (a
    legitimate reordering)."""

    split = False

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.a, self.b = torch.nn.Linear(128, 256), torch.nn.Linear(256, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.a.weight
        h = (x[:, :64] @ w[:, :64].T + x[:, 64:] @ w[:, 64:].T + self.a.bias) if SplitNet.split else self.a(x)
        return self.b(torch.nn.functional.gelu(h))


class Flip(torch.nn.Module):
    """A bf16-able linear (64 -> 64); with ``Flip.flip`` set (the target's patch set), the output closest
    to 0.04 has its sign flipped (a kernel that writes one element wrong)."""

    flip = False

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)
        torch.nn.init.normal_(self.lin.weight, std=0.125, generator=torch.Generator().manual_seed(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if Flip.flip:
            i = (y.float().abs() - 0.04).abs().argmin()
            y = y.flatten().clone()
            y[i] = -y[i]
            y = y.view(x.shape[0], -1)
        return y


def test_a_sign_flipped_output_element_fails_the_golden_floor():
    # one output of 0.04 negated among 4,096: 77x outside the allclose bound, within the built-in budget and
    # every golden ratio within its limit; the golden shows it is no rounding (judge.golden's gross elements)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    assert case("bf16").check("flip", Flip(), x).status == "pass"
    with pytest.raises(ParityError, match=r"1 element\(s\) beyond rounding by the float64 golden"):
        case("bf16", _switched(Flip, "flip")).check("flip", Flip(), x)


@pytest.mark.parametrize("output", [0.04, 0.01])
def test_a_sign_flipped_output_element_fails_fp16_by_default(output):
    # the same linear under fp16: err/tol 77 (0.04) or 20 (0.01), within the built-in budget's 100x, passed plain
    # allclose, fp16's default until 2026-12; the golden floor, now its default, finds the element gross
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))

    class FlipAt(Flip):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x)
            if Flip.flip:
                i = (y.float().abs() - output).abs().argmin()
                y = y.flatten().clone()
                y[i] = -y[i]
                y = y.view(x.shape[0], -1)
            return y

    assert case("fp16").check("flip", FlipAt(), x).status == "pass"
    with pytest.raises(ParityError, match=r"1 element\(s\) beyond rounding by the float64 golden"):
        case("fp16", _switched(Flip, "flip")).check("flip", FlipAt(), x)
    flipped = case("fp16", _switched(Flip, "flip")).check("flip", FlipAt(), x, policy="allclose")
    assert flipped.status == "pass"  # what plain allclose, still one option away, lets through


class ReluMLP(torch.nn.Module):
    """256 -> 1024 -> ReLU -> 32; with ``ReluMLP.unfused`` set (the target's patch set), the first linear adds its
    bias after the matmul's result is rounded to fp16 (a GEMM without a fused bias epilogue): correct, other rounding."""

    unfused = False

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.l1, self.l2 = torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 32)
        with torch.no_grad():
            for lin in (self.l1, self.l2):
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) / lin.in_features ** 0.5)
                lin.bias.copy_(torch.randn(lin.bias.shape, generator=g) / 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.l1.weight) + self.l1.bias.half() if ReluMLP.unfused else self.l1(x)
        return self.l2(F.relu(y))


def test_a_gradient_through_a_relu_whose_mask_rounding_flips_passes_fp16():
    # seed 23: one pre-activation near 0 falls on the other side of the ReLU on the target, dropping one sample's share
    # of a weight-gradient row (5 elements 16x outside the bound, the reference there equal to the float32 golden):
    # a gradient is discontinuous in the forward's rounding, so it gets no gross-element test
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(123))
    kwargs = dict(loss_fn=lambda out: out.float().pow(2).sum() / 64, max_grad_norm=None)
    record = case("fp16", _switched(ReluMLP, "unfused")).train_step("step", ReluMLP(23), {"x": x}, **kwargs)
    assert record.status == "pass" and record.policy == "golden"
    taken = next(leaf for leaf in record.result.leaves if leaf.path == "grad.l1.weight")
    assert 0 < taken.mismatched <= taken.allowed and taken.err_ratio > G.GROSS_ERR_RATIO and taken.gross == 0


def _one_adamw_step(module, batch, recipe):
    """A training loop of one AdamW step at lr 1e-3 (no optimizer replay for a custom loop)."""
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    with recipe.context(batch["x"].device) if recipe is not None else contextlib.nullcontext():
        loss = (module(batch["x"]).float() - batch["y"]).square().mean()
    loss.backward()
    out = {"loss": loss.detach(), **{f"grad.{n}": p.grad.detach().clone() for n, p in module.named_parameters()}}
    opt.step()
    return {**out, **{f"param.{n}": p.detach().clone() for n, p in module.named_parameters()}}


_split_k = _switched(SplitNet, "split")


def test_allclose_floor_keeps_a_rounding_flip_the_budget_excuses():
    # bf16, split-K forward: one parameter element of 2,048 takes AdamW's first step the other way (its gradient
    # is rounding noise): 2·lr off, twice the allclose bound, where the ratio test breaks down (ratio ~1e3)
    g = torch.Generator().manual_seed(7)
    batch = {"x": torch.randn(32, 128, generator=g), "y": torch.randn(32, 8, generator=g)}
    case = ParityCase(ParitySession(CPU, reference="cpu"), "tests/test_runner.py::t", "bf16", patches=_split_k)
    record = case.train_step("step", SplitNet(), batch, loop=_one_adamw_step)
    assert record.status == "pass"
    floored = [leaf for leaf in record.result.leaves if leaf.mismatched and leaf.over_limit]  # the floor passes them
    assert floored and all(leaf.within_floor and 1 < leaf.err_ratio <= G.FLOOR_OUTLIER_ERR_RATIO for leaf in floored)


def test_a_module_with_an_inf_mask_keeps_its_copies_between_checks():
    # a causal mask of -inf (a non-persistent buffer): its fingerprint summary holds a NaN, which a dict comparison
    # finds unequal to itself; every check dropped the session's copies and goldens
    model = Proj().eval()
    model.register_buffer("mask", torch.full((8, 8), -math.inf).triu(1), persistent=False)
    session = ParitySession(CPU, reference="cpu")
    assert not session.note_state(model, check_hashes(model, (X,), {}))
    assert not session.note_state(model, check_hashes(model, (X,), {}))
    with torch.no_grad():
        model.mask[0, 0] = 1.0
    assert session.note_state(model, check_hashes(model, (X,), {}))


class Wrapped(torch.nn.Module):
    """A model whose one submodule (``inner``, an ``Edited``) holds its weight."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Edited()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).relu()


def test_a_submodule_checked_first_after_an_edit_gets_a_golden_of_its_new_weights():
    # the golden runner takes submodules from its float64 copy of the root (as the Aurora suite sets it up): the
    # root is checked, a checkpoint is loaded, then a submodule is checked for the first time (note_state has no
    # earlier state of it): its golden must come from the new weights
    model = Wrapped().eval()
    session = ParitySession(CPU, reference="cpu", golden_runner=G.GoldenRunner(root=model))
    case = ParityCase(session, "tests/test_runner.py::t", "bf16", patches=_edited_fault)
    assert case.check("whole", model, X[:4]).status == "pass"
    _load_new_weights(model)
    with pytest.raises(ParityError, match="golden policy"):
        case.check("inner", model.inner, X[:8])
    assert torch.equal(session.golden_runner._copy(model.inner, torch.float64).w, model.inner.w.detach().double())


class ScaledEdited(Edited):
    """An ``Edited`` whose output is scaled by its attribute ``_scale`` (private) times ``scale`` (public)."""

    def __init__(self) -> None:
        super().__init__()
        self._scale = 1.0
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * (self._scale * self.scale)


@pytest.mark.parametrize("edit", ["_scale", "scale"])
def test_a_submodule_checked_first_after_an_attribute_edit_gets_a_golden_of_its_new_state(edit):
    # as above, with an attribute edited instead of the weights: no version counter sees it, the root's
    # fingerprints do (before, both sides scaled by 3 were as far from the stale golden: the fault passed)
    model = Wrapped().eval()
    model.inner = ScaledEdited().eval()
    session = ParitySession(CPU, reference="cpu", golden_runner=G.GoldenRunner(root=model))
    case = ParityCase(session, "tests/test_runner.py::t", "bf16", patches=_edited_fault)
    assert case.check("whole", model, X[:4]).status == "pass"
    assert session.golden_runner._root_copies
    setattr(model.inner, edit, 3.0)
    with pytest.raises(ParityError, match="golden policy"):
        case.check("inner", model.inner, X[:8])


class Dropping(torch.nn.Module):
    """A linear whose input goes through ``nn.Dropout(0.1)`` (``F.dropout`` in training mode)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.drop = torch.nn.Linear(8, width), torch.nn.Dropout(0.1)

    def forward(self, x):
        return self.lin(self.drop(x))


def dropout_p(p: float):
    """A patch set whose ``F.dropout`` drops with ``p`` whatever it is asked (a port's dropout of another p)."""
    @contextlib.contextmanager
    def patches(device):
        original = torch.nn.functional.dropout
        torch.nn.functional.dropout = lambda x, _p=0.5, training=True, inplace=False: original(x, p, training, inplace)
        try:
            yield
        finally:
            torch.nn.functional.dropout = original
    return patches


def test_a_patch_sets_own_dropout_that_does_not_run_is_said_in_the_note():
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    loss = lambda out: out.square().mean()  # noqa: E731
    clean = ParityCase(ParitySession(CPU, reference="cpu"), "t.py::drop", "fp32").train_step(
        "step", Dropping(), x, loss_fn=loss)
    assert "did not run" not in (clean.extra.get("policy_note") or "")
    record = ParityCase(ParitySession(CPU, reference="cpu"), "t.py::drop", "fp32", patches=dropout_p(0.15)).train_step(
        "step", Dropping(), x, loss_fn=loss)
    assert ("the patch set's own torch.nn.functional.dropout did not run: under the shared random stream both sides "
            "call the plugin's (the same draws on both), so the patch set's version is not judged here"
            ) in record.extra["policy_note"]
    # replaced by the test itself (not the patch set), or replaced by the patch set and never called: no note
    original = torch.nn.functional.dropout
    torch.nn.functional.dropout = lambda x, p=0.5, training=True, inplace=False: original(x, p, training, inplace)
    try:
        record = ParityCase(ParitySession(CPU, reference="cpu"), "t.py::drop", "fp32").train_step(
            "step", Dropping(), x, loss_fn=loss)
    finally:
        torch.nn.functional.dropout = original
    assert "did not run" not in (record.extra.get("policy_note") or "")
    record = ParityCase(ParitySession(CPU, reference="cpu"), "t.py::drop", "fp32", patches=dropout_p(0.15)).check(
        "eval", Dropping().eval(), x)
    assert "did not run" not in (record.extra.get("policy_note") or "")


def test_a_trajectory_says_its_patch_sets_dropout_did_not_run():
    from pytest_npu_parity.runtime.trajectory import TrajectoryLoop

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
    batches = [(x[i:i + 8], y[i:i + 8]) for i in range(0, 32, 8)]
    loop = TrajectoryLoop(steps=4, learning_rate=1e-3, loss_fn=torch.nn.functional.mse_loss)
    record = ParityCase(ParitySession(CPU, reference="cpu"), "t.py::traj", "fp32", patches=dropout_p(0.6)).trajectory(
        "curve", Dropping(width=1), batches, loop=loop)
    assert record.status == "pass"  # the same draws on both sides: the note is what tells
    assert "the patch set's own torch.nn.functional.dropout did not run" in record.extra["policy_note"]
