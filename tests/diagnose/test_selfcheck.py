"""The vacuity guard and --parity-selfcheck: checks that cannot fail are found and fail."""
from __future__ import annotations

import math

import pytest
import torch

from pytest_npu_parity.compare import ParityError, compare
from pytest_npu_parity.policy import FP32, LOW_PRECISION, Tolerance
from pytest_npu_parity.runner import ParityCase, ParitySession
from pytest_npu_parity.selfcheck import (SelfCheck, output_teeth, perturb_inputs, perturb_leaf, scaled_parameter,
                                         sensitive_parameter, target_module, teeth_summary, vacuity_problem)


def _linear() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(6, 4).eval()


X = torch.linspace(-1, 1, 18).reshape(3, 6)


def _case(selfcheck: bool = True, recipe: str = "fp32", **kwargs) -> ParityCase:
    session = ParitySession(torch.device("cpu"), reference="cpu", check_hooks=[SelfCheck()] if selfcheck else [])
    return ParityCase(session, "tests/t.py::test", recipe, **kwargs)


# -- vacuity guard ------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0.0, 3.5, math.nan])
def test_constant_reference_output_is_vacuous(value):
    problem = vacuity_problem({"out": torch.full((4, 3), value), "loss": torch.tensor(1.0)})
    assert problem is not None and "'out' is all" in problem and "4x3" in problem


def test_varying_or_scalar_outputs_are_not_vacuous():
    assert vacuity_problem({"a": torch.zeros(5), "b": torch.arange(5.0)}) is None  # one leaf varies
    assert vacuity_problem({"loss": torch.tensor(0.0)}) is None  # nothing with more than one element
    assert vacuity_problem({"ids": torch.zeros(5, dtype=torch.int64)}) is None  # integers are not judged
    assert vacuity_problem({"a": torch.tensor([1.0, math.nan])}) is None
    assert vacuity_problem({"z": torch.full((3,), 1 + 2j)}) is not None


def test_deliberately_vacuous_check_is_flagged_and_fails():
    zero = torch.nn.Linear(6, 4)
    torch.nn.init.zeros_(zero.weight)
    torch.nn.init.zeros_(zero.bias)  # fresh zero-initialized output layer: the output is all 0
    case = _case(selfcheck=False)
    with pytest.raises(ParityError, match=r"is vacuous: its reference output is constant: '<output>' is all 0"):
        case.check("zero_head", zero, X)
    record = case.records[-1]
    assert record.status == "fail" and record.result.passed  # within tolerance, failed for vacuity
    assert {row["verdict"] for row in record.rows()} == {"fail"}
    assert "vacuous" in record.rows()[0]["problem"]


def test_vacuous_ok_allows_it_with_a_reason():
    const = torch.nn.Linear(6, 4)
    torch.nn.init.zeros_(const.weight)
    torch.nn.init.constant_(const.bias, 0.5)  # every output element 0.5
    case = _case(selfcheck=False)
    record = case.check("const", const, X, vacuous_ok="bias-only head, checked elsewhere")
    assert record.status == "pass" and record.extra["vacuous_ok"] == "bias-only head, checked elsewhere"
    marked = _case(selfcheck=False, vacuous_ok="marker reason")
    assert marked.check("const", const, X).extra["vacuous_ok"] == "marker reason"
    with pytest.raises(ParityError, match="vacuous"):
        _case(selfcheck=False).compare("given", torch.zeros(3, 2), torch.zeros(3, 2))


# -- output teeth ----------------------------------------------------------------------------------


def test_perturb_leaf_moves_one_more_element_than_the_budget_allows():
    e = torch.linspace(1, 2, 4000)
    tol = Tolerance(rtol=1e-3, atol=1e-3, budget=1e-3)  # 4 elements allowed
    p = perturb_leaf(e.clone(), e, tol)
    moved = (p != e).nonzero().reshape(-1)
    assert len(moved) == 5
    err = (p[moved].double() - e[moved].double()).abs() / (tol.atol + tol.rtol * e[moved].double().abs())
    assert torch.allclose(err, torch.full_like(err, 2.0), rtol=1e-3)  # 2x the allowed error (fp32 rounding)
    assert not compare(p, e, tol).passed
    assert compare(perturb_leaf(e.clone(), e, tol.replace(budget=2e-3)), e, tol.replace(budget=2e-3)).passed is False


def test_budget_allowing_everything_has_no_teeth():
    e = torch.linspace(0, 1, 10)
    assert perturb_leaf(e, e, FP32.replace(budget=1.0, source="check")) is None
    toothless = output_teeth({"y": e}, {"y": e}, FP32.replace(budget=1.0, source="check"))
    assert "allows all 10 elements" in toothless["y"]


def test_output_teeth_for_low_precision_integer_and_bool_leaves():
    e = torch.linspace(100, 900, 64).to(torch.bfloat16)  # 2x allowed error is below one bf16 ulp here
    ints = torch.arange(10)
    flags = torch.arange(10) % 2 == 0
    assert output_teeth({"b": e, "i": ints, "f": flags}, {"b": e, "i": ints, "f": flags}, LOW_PRECISION) == {}
    p = perturb_leaf(ints, ints, Tolerance(0.0, 0.0))
    assert int((p != ints).sum()) == 1


# -- weight teeth ----------------------------------------------------------------------------------


def test_sensitive_parameter_prefers_the_largest_trainable_matrix():
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Linear(16, 8), torch.nn.LayerNorm(8))
    assert sensitive_parameter(model) == "1.weight"
    model[1].weight.requires_grad_(False)
    assert sensitive_parameter(model) == "0.weight"
    assert sensitive_parameter(torch.nn.LayerNorm(8)) in ("weight", "bias")
    assert sensitive_parameter(torch.nn.ReLU()) is None


def test_scaled_parameter_restores_bit_exactly():
    layer = _linear()
    before = layer.weight.detach().clone()
    with scaled_parameter(layer, "weight", 1 + 1e-4):
        assert not torch.equal(layer.weight, before)
    assert torch.equal(layer.weight, before)


def test_healthy_module_check_has_teeth():
    record = _case().check("linear", _linear(), X)
    assert record.extra["teeth"] is True
    report = record.extra["selfcheck"]
    assert report["weight"]["weight"] == "weight" and report["weight"]["caught"]
    assert report["weight"]["factor"] == pytest.approx(1 + 1e-4)  # 1 + 10·rtol of fp32
    assert report["output_leaves_without_teeth"] == {} and report["input_sensitive"] is True


class IgnoresWeight(torch.nn.Module):
    """A check whose output never sees the module's only matrix (a dead branch)."""

    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Linear(6, 6)

    def forward(self, x):
        return torch.tanh(x)


def test_check_without_teeth_fails_unless_marked():
    case = _case()
    with pytest.raises(ParityError, match=r"has no teeth: scaling weight 'unused.weight' by 1\.0001 on the target "
                                          r"still passes"):
        case.check("dead", IgnoresWeight(), X)
    record = case.records[-1]
    assert record.extra["teeth"] is False and record.status == "fail"
    allowed = _case().check("dead", IgnoresWeight(), X, vacuous_ok="checks tanh only")
    assert allowed.extra["teeth"] is False and allowed.status == "pass"


class BiasOnly(torch.nn.Module):
    """The output depends on a parameter but not on the input: non-constant, yet input-insensitive."""

    def __init__(self):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.linspace(-1, 1, 6))

    def forward(self, x):
        return self.bias.expand_as(x) + 0 * x


def test_input_insensitive_module_is_vacuous_in_selfcheck_mode():
    assert _case(selfcheck=False).check("bias", BiasOnly(), X).status == "pass"  # the cheap guard passes it
    case = _case()
    with pytest.raises(ParityError, match="is vacuous: its reference output does not change when its floating inputs"):
        case.check("bias", BiasOnly(), X)
    assert case.records[-1].extra["teeth"] is True  # it has teeth for its weight, yet ignores its data


def test_input_insensitive_function_is_only_noted():
    record = _case().check("mask", lambda like, n: torch.triu(torch.ones(n, n, device=like.device), 1), X, 4)
    assert record.status == "pass" and record.extra["teeth"] is True
    assert record.extra["selfcheck"]["weight"] is None  # a function has no weight to perturb
    assert "does not depend on the input values" in record.extra["selfcheck"]["note"]


def test_weight_perturbation_acts_on_the_module_the_target_runs():
    # bf16-weights places a bf16 copy (cached by the session): scaling the fp32 original would not
    # reach the target run, so the check would look toothless.
    layer = _linear()
    case = _case(recipe="bf16-weights")
    record = case.check("linear", layer, X)
    assert record.extra["teeth"] is True
    placed = target_module(case, layer)
    assert placed is not layer and placed.weight.dtype == torch.bfloat16
    assert target_module(_case(), layer) is layer  # fp32 on the CPU: the object itself runs


def test_train_step_selfcheck_leaves_out_the_scaled_parameter_itself():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    record = _case().train_step("step", model, {"input": X}, loss_fn=lambda out: out.square().mean())
    weight = record.extra["selfcheck"]["weight"]
    assert weight["caught"] and weight["weight"] == "0.weight"
    assert weight["worst_leaf"] != "param.0.weight"
    assert record.extra["teeth"] is True


def test_perturb_inputs_moves_only_floating_tensors():
    (args, kwargs), moved = perturb_inputs(((X, 3), {"ids": torch.arange(3), "y": X}), seed=0)
    assert moved == 2 and args[1] == 3 and torch.equal(kwargs["ids"], torch.arange(3))
    assert not torch.equal(args[0], X) and (args[0] - X).abs().max() < 0.1


def test_teeth_summary_counts_one_verdict_per_check():
    rows = [{"test_id": "a", "check": "c", "recipe": "fp32", "teeth": True},
            {"test_id": "a", "check": "c", "recipe": "fp32", "teeth": True},
            {"test_id": "a", "check": "d", "recipe": "fp32", "teeth": False, "teeth_problem": "x"},
            {"test_id": "a", "check": "e", "recipe": "fp32"}]
    with_teeth, measured, without = teeth_summary(rows)
    assert (with_teeth, measured) == (1, 2) and [r["check"] for r in without] == ["d"]


# -- through pytest ------------------------------------------------------------------------------

SELFCHECK_TESTS = """
import pytest
import torch

class IgnoresWeight(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(x)

X = torch.linspace(-1, 1, 12).reshape(3, 4)

def test_linear(parity):
    torch.manual_seed(0)
    parity.check("linear", torch.nn.Linear(4, 2).eval(), X)

def test_dead_branch(parity):
    parity.check("dead", IgnoresWeight(), X)

@pytest.mark.parity(vacuous_ok="the weight is exercised by test_linear")
def test_dead_branch_marked(parity):
    parity.check("dead", IgnoresWeight(), X)

def test_zero_output(parity):
    parity.check("zeros", lambda x: x * 0, X)
"""


def test_plugin_selfcheck_reports_the_share_with_teeth(pytester):
    pytester.makepyfile(test_selfcheck_suite=SELFCHECK_TESTS)
    result = pytester.runpytest("--npu-parity", "--parity-selfcheck", "--parity-device", "cpu",
                                "--parity-dtypes", "fp32", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines([
        "*teeth: 2/4 (50 %) of the checks fail when their output or a weight is perturbed beyond tolerance",
        "*no teeth: test_selfcheck_suite.py::test_dead_branch[[]fp32[]] check 'dead' (fp32): scaling weight*",
        "*no teeth: test_selfcheck_suite.py::test_dead_branch_marked[[]fp32[]] check 'dead' (fp32): *"
        "[[]vacuous_ok: the weight is exercised by test_linear[]]",
    ])
    result.stdout.fnmatch_lines(["*Parity check 'zeros' is vacuous: its reference output is constant: '<output>' is all 0*"])


def test_plugin_without_selfcheck_prints_no_teeth_line(pytester):
    pytester.makepyfile(test_selfcheck_suite=SELFCHECK_TESTS)
    result = pytester.runpytest("--npu-parity", "--parity-device", "cpu", "--parity-dtypes", "fp32",
                                "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, failed=1)  # only the constant output fails: the cheap guard is always on
    assert "teeth:" not in result.stdout.str()


class NormalizedFFN(torch.nn.Module):
    """An FFN whose last linear feeds a training-mode BatchNorm: a uniform scale of that weight is
    invisible by design, so the check names the first linear as its fault weight."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(6, 6)
        self.down = torch.nn.Linear(6, 6)
        self.norm = torch.nn.BatchNorm1d(6)

    def forward(self, x):
        return self.norm(self.down(torch.relu(self.up(x))))


def test_fault_weight_names_the_perturbed_parameter():
    torch.manual_seed(0)
    ffn = NormalizedFFN().train()
    assert sensitive_parameter(ffn) == "up.weight"  # first of equals, not the invariant one
    with pytest.raises(ParityError, match="has no teeth: scaling weight 'down.weight'"):
        _case().check("ffn", ffn, X, fault_weight="down.weight")
    record = _case().check("ffn", ffn, X, fault_weight="up.weight")
    assert record.extra["selfcheck"]["weight"]["weight"] == "up.weight" and record.extra["teeth"]
    with pytest.raises(ValueError, match="fault_weight='nope' is not a floating parameter of NormalizedFFN"):
        _case().check("ffn", ffn, X, fault_weight="nope")
