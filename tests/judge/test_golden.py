"""The golden policy's arithmetic against hand-computed cases, its verdicts, parsing and the golden runner."""
from __future__ import annotations

import json
import math

import pytest
import torch

from pytest_npu_parity import golden as G
from pytest_npu_parity.policy import LOW_PRECISION, Tolerance


def f64(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def f32(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


# --------------------------------------------------------------------------------------------
# metrics of one side


def test_side_metrics_by_hand():
    g = f64(1.0, 2.0, 4.0, 1e-7)
    x = f64(1.1, 2.0, 3.0, 1e-7 + 2e-9)
    mask = torch.ones(4, dtype=torch.bool)
    small = g.abs() < 1e-6  # only the last element
    m = G.side_metrics(x, g, mask, small, small_atol=1e-9)
    # errors 0.1, 0, 1, 2e-9
    assert m.rmse == pytest.approx(math.sqrt((0.01 + 0 + 1 + 4e-18) / 4), rel=1e-12)
    assert m.max_rel == pytest.approx(0.25)  # 1 / 4
    assert m.mean_rel == pytest.approx((0.1 + 0 + 0.25) / 3)
    assert m.small_share == 1.0  # the one small element is off by 2e-9 > 1e-9
    assert m.balance == pytest.approx(abs(2 - 1) / 4)  # two above the golden, one below
    assert (m.small, m.normal) == (1, 3)


def test_side_metrics_empty_mask_is_all_zero():
    g = f64(1.0, 2.0)
    m = G.side_metrics(g + 1, g, torch.zeros(2, dtype=torch.bool), torch.zeros(2, dtype=torch.bool), 1e-9)
    assert (m.rmse, m.max_rel, m.mean_rel, m.small_share, m.small, m.normal) == (0.0, 0.0, 0.0, 0.0, 0, 0)


@pytest.mark.parametrize("target, reference, floor, expected", [
    (0.0, 0.0, 0.0, 1.0),          # neither side has the error: msprobe's 0/0 = 1
    (3.0, 1.5, 0.0, 2.0),
    (1e-9, 0.0, 0.0, math.inf),    # the reference is exact, the target is not
    (1.0, 0.1, 0.5, 2.0),          # the floor replaces a reference better than rounding
    (0.2, 0.1, 0.05, 2.0),         # a floor below the reference changes nothing
])
def test_ratio(target, reference, floor, expected):
    assert G.ratio(target, reference, floor) == expected


def test_ratio_nan_stays_nan():
    assert math.isnan(G.ratio(math.nan, 1.0))


# --------------------------------------------------------------------------------------------
# one leaf


def _dyadic(target_error: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Golden [1, 2, 4, 8]; the reference is off by 2**-10 in the first element, the target by
    ``target_error`` there. Every value is exact in fp32, so the rounding floor is 0."""
    g = f64(1.0, 2.0, 4.0, 8.0)
    e = f32(1.0 + 2 ** -10, 2.0, 4.0, 8.0)
    a = f32(1.0 + target_error, 2.0, 4.0, 8.0)
    return a, e, g


def test_ratios_of_a_target_twice_as_wrong_are_two_and_pass_at_the_limit():
    a, e, g = _dyadic(2 ** -9)
    leaf = G.judge_golden_tensors(a, e, g, G.DEFAULT_GOLDEN, path="y")
    assert leaf.ratios == {"rmse": 2.0, "max_rel": 2.0, "mean_rel": 2.0, "small_share": 1.0, "max_abs": 2.0}
    assert leaf.target.rmse == pytest.approx(2 ** -9 / 2)  # sqrt(2**-18 / 4)
    assert leaf.reference.max_rel == 2 ** -10
    assert leaf.floor.rmse == 0.0
    assert leaf.passed  # ratio == limit passes (msprobe: error only above the threshold)
    assert leaf.worst_ratio == ("rmse", 1.0)


def test_a_target_three_times_as_wrong_fails_on_rmse_and_mean_rel_only():
    a, e, g = _dyadic(3 * 2 ** -10)
    leaf = G.judge_golden_tensors(a, e, g, G.DEFAULT_GOLDEN)
    assert leaf.ratios["rmse"] == 3.0 and leaf.ratios["mean_rel"] == 3.0 and leaf.ratios["max_rel"] == 3.0
    assert leaf.over_limit == {"rmse": 3.0, "mean_rel": 3.0}  # max_rel's limit is 10
    assert not leaf.passed
    assert G.judge_golden_tensors(a, e, g, G.DEFAULT_GOLDEN.replace(rmse_ratio=3, mean_rel_ratio=3)).passed


def test_a_target_better_than_the_reference_passes():
    a, e, g = _dyadic(0.0)
    leaf = G.judge_golden_tensors(a, e, g, G.DEFAULT_GOLDEN)
    assert leaf.ratios["rmse"] == 0.0 and leaf.passed


def test_exact_reference_makes_any_target_error_infinite():
    g = f64(1.0, 2.0)
    e = f32(1.0, 2.0)
    a = f32(1.0, 2.0 + 2 ** -22)  # one fp32 ulp of 2
    leaf = G.judge_golden_tensors(a, e, g, G.DEFAULT_GOLDEN)
    assert leaf.ratios["rmse"] == math.inf and not leaf.passed


def test_rounding_floor_when_the_golden_is_not_representable():
    third = 1.0 / 3.0
    g = f64(third)
    e = f32(third)  # correctly rounded: its error is the floor
    below = torch.nextafter(e, torch.tensor(0.0, dtype=torch.float32))
    a = torch.nextafter(below, torch.tensor(0.0, dtype=torch.float32))  # two fp32 ulps below
    leaf = G.judge_golden_tensors(a, e, g, G.DEFAULT_GOLDEN)
    floor = abs(float(e) - third)
    assert leaf.floor.rmse == pytest.approx(floor, rel=1e-12)
    assert leaf.ratios["rmse"] == pytest.approx(abs(float(a) - third) / floor, rel=1e-12)
    assert leaf.ratios["rmse"] > 2 and not leaf.passed


def _bf16_kernel(g: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A correct bf16 kernel's output of the golden ``g``: an accumulation error (4e-3, as a long bf16
    reduction has), then bf16 rounding."""
    return (g + 4e-3 * torch.randn(g.shape, dtype=torch.float64, generator=gen)).to(torch.bfloat16)


def test_a_few_grossly_wrong_elements_of_a_large_leaf_fail_on_the_largest_error():
    """32 values swapped in pairs among 2 M bf16 elements (a kernel that swaps two vocabulary rows of
    an LM head): each is off by about one unit, thousands of times the tolerance, yet the averaged
    metrics barely move and the largest relative error stays the reference's (its near-zero
    elements). The largest absolute error catches them; another correct kernel passes."""
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(1 << 21, dtype=torch.float64, generator=gen)
    e, a = _bf16_kernel(g, gen), _bf16_kernel(g, gen)
    policy = G.default_golden_for_recipe("bf16")
    assert G.judge_golden_tensors(a, e, g, policy, work_dtype=torch.bfloat16).passed
    wrong = a.clone()
    where = torch.nonzero((g.abs() > 0.5) & (g.abs() < 2))[:32, 0]
    wrong[where] = a[where.view(-1, 2).flip(1).reshape(-1)]  # pairs swapped
    leaf = G.judge_golden_tensors(wrong, e, g, policy, work_dtype=torch.bfloat16)
    assert leaf.ratios["rmse"] < 2 and leaf.ratios["max_rel"] < 10 and leaf.ratios["mean_rel"] < 2
    assert not leaf.passed
    assert set(leaf.over_limit) == {"max_abs"} and leaf.ratios["max_abs"] > 10
    # the message and the table show the ratio that failed, and what it is
    message = G.judge_golden({"logits": wrong}, {"logits": e}, {"logits": g}, policy, work_dtype=torch.bfloat16,
                             name="lm_head").format()
    assert "max_abs ratio" in message and "(the largest absolute error, held to the max_rel limit)" in message
    assert "max_abs t/r (ratio)" in message


def _two_bf16_kernels(g: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Two correct bf16 kernels of the golden ``g`` that accumulate in fp32, as a CPU's and an NPU's
    do: both carry the error of the bf16 inputs they share (2e-3 here, as a bf16 linear of 64 has),
    each its own in the accumulator's last bits (1e-6), then bf16 rounding: they round a few
    elements apart."""
    shared = g + 2e-3 * torch.randn(g.shape, dtype=torch.float64, generator=gen)
    return tuple((shared + 1e-6 * torch.randn(g.shape, dtype=torch.float64, generator=gen)).to(torch.bfloat16)
                 for _ in range(2))


_FLOOR = G.default_golden_for_recipe("bf16").replace(allclose_floor=True)


def _negated(a: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    wrong = a.clone()
    wrong.view(-1)[where] = -wrong.view(-1)[where]
    return wrong


def test_a_sign_flipped_element_the_budget_would_take_fails_as_a_gross_element():
    """One output of 0.04 negated among 4,096 bf16 elements: 77x outside the allclose bound, within the
    built-in budget's 100x, and the leaf's averages and maxima hardly move. The golden shows the
    target's error there is far beyond the reference's; another correct kernel passes."""
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(64, 64, dtype=torch.float64, generator=gen)
    e, a = _two_bf16_kernels(g, gen)
    judge = lambda x, path="y": G.judge_golden_tensors(x, e, g, _FLOOR, tolerance=LOW_PRECISION, path=path,  # noqa: E731
                                                       work_dtype=torch.bfloat16)
    fine = judge(a)
    assert fine.passed and fine.gross == 0 and fine.mismatched <= fine.allowed
    i = int((g.abs() - 0.04).abs().argmin())
    leaf = judge(_negated(a, torch.tensor([i])))
    # what hid it: within the budget, within 100x the bound, every ratio within its limit
    assert 0 < leaf.mismatched <= leaf.allowed and G.GROSS_ERR_RATIO < leaf.err_ratio <= 100 and not leaf.over_limit
    assert not leaf.passed and not leaf.within_floor
    assert leaf.gross == 1 and leaf.gross_index == (i // 64, i % 64)
    assert leaf.gross_values == (float(-a.view(-1)[i]), float(e.view(-1)[i]), float(g.view(-1)[i]))
    message = G.judge_golden({"y": _negated(a, torch.tensor([i]))}, {"y": e}, {"y": g}, _FLOOR,
                             tolerance=LOW_PRECISION, work_dtype=torch.bfloat16, name="proj").format()
    assert f"1 element(s) beyond rounding by the float64 golden, first at index {(i // 64, i % 64)}" in message
    # a training step's parameters after the step keep the budget's 100x: AdamW's ±lr from a gradient of
    # rounding noise has its sign decided by the golden's gradient (runtime.training.rounding_level_params);
    # so do its gradients, which a ReLU's mask makes discontinuous in the forward's rounding (a flip there passes)
    for path in ("param.w", "rank1.param.w", "grad.w", "rank1.grad.w"):
        stepped = judge(_negated(a, torch.tensor([i])), path)
        assert stepped.passed and stepped.within_floor and stepped.gross == 0
    assert not judge(_negated(a, torch.tensor([i])), "gradient.w").passed  # by the training steps' names only
    # a budget of the user's takes any amount, as before
    own = G.judge_golden_tensors(_negated(a, torch.tensor([i])), e, g, _FLOOR, work_dtype=torch.bfloat16,
                                 tolerance=LOW_PRECISION.replace(budget=1e-3, reason="known"))
    assert own.passed and own.gross == 0


def test_small_logits_negated_beside_large_ones_fail_as_gross_elements():
    """32 logits of 0.1–0.2 negated among 2 M bf16 logits whose rows each hold one of 25.3: the
    largest absolute error is set by rounding the 25.3s (the max_abs ratio stays under its limit), the
    averages over 2 M elements hardly move, and each flipped logit is over 100x outside the bound, so
    the floor leaves the leaf to the ratios: before the gross-element test it passed."""
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(16, 1 << 17, dtype=torch.float64, generator=gen)
    g[:, 7] = 25.3
    e, a = _two_bf16_kernels(g, gen)
    assert G.judge_golden_tensors(a, e, g, _FLOOR, tolerance=LOW_PRECISION, work_dtype=torch.bfloat16).passed
    where = torch.nonzero((g.abs() > 0.1) & (g.abs() < 0.2))[:32]
    flat = where[:, 0] * g.shape[1] + where[:, 1]
    leaf = G.judge_golden_tensors(_negated(a, flat), e, g, _FLOOR, tolerance=LOW_PRECISION, work_dtype=torch.bfloat16)
    assert leaf.mismatched <= leaf.allowed and leaf.err_ratio > 100 and not leaf.over_limit  # what hid it
    assert not leaf.passed and leaf.gross == 32
    assert leaf.gross_index == tuple(int(k) for k in where[0])


def test_a_more_accurate_target_is_no_gross_element_where_the_reference_rounds_luckily():
    """A residual stream kept in fp32 under bf16 autocast, with one large channel its branch cancels:
    the reference adds the bf16-rounded branch, the target its fp32 GEMM output (a fused epilogue, the
    more accurate port). Some elements sit 30x outside the allclose bound, and at a few the reference's
    own rounding happens to cancel the input rounding both sides share, so the target's error there is
    50x the reference's; but it stays within the reference's largest error elsewhere in the leaf, and
    every ratio favours the target."""
    bf, n = torch.bfloat16, 2048
    gen = torch.Generator().manual_seed(100)
    x = torch.randn(64, n, generator=gen)
    x[:, 0] = 8 + 8 * torch.rand(64, generator=gen)
    w = torch.randn(n, n, generator=torch.Generator().manual_seed(0)) * 0.05 / math.sqrt(n)
    w[0, 0] = -0.997
    with torch.autocast("cpu", dtype=bf):
        e = x + torch.nn.functional.linear(x, w)
    a = x + x.to(bf).float() @ w.to(bf).float().t()
    g = x.double() + x.double() @ w.double().t()
    leaf = G.judge_golden_tensors(a, e, g, _FLOOR, tolerance=LOW_PRECISION, work_dtype=bf)
    assert 0 < leaf.mismatched <= leaf.allowed and leaf.err_ratio > G.GROSS_ERR_RATIO  # the test applies
    local = ((a.double() - g).abs() / (e.double() - g).abs().clamp_min(1e-12))[(a - e).abs() > 0.016 * (1 + e.abs())]
    assert local.max() > 10  # the reference's error at one element would call it gross
    assert leaf.passed and leaf.gross == 0


def test_max_abs_is_not_reported_under_msprobes_limit_set_which_does_not_measure_it():
    g = torch.randn(4096, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    a = g.to(torch.bfloat16)
    a[0] += 3
    leaf = G.judge_golden_tensors(a, g.to(torch.bfloat16), g, G.MSPROBE_GOLDEN, work_dtype=torch.bfloat16)
    row = leaf.to_row()
    assert "max_abs" not in leaf.ratios
    assert row["golden_max_abs_ratio"] is None and row["golden_max_abs_target"] is None
    assert row["golden_max_abs_reference"] is None
    assert G.format_golden_table([leaf])[1].split()[-2] == "-"  # the max_abs cell


def test_small_value_share_ratio_has_one_element_resolution():
    g = f64(1e-7, 2e-7, 3e-7, 4e-7, 1.0)  # four small values (fp32 threshold 1e-6), one normal
    e = g.to(torch.float32)
    one_wrong = e.clone()
    one_wrong[0] += 5e-9  # > 1e-9: one small element wrong
    # rmse, mean_rel and max_abs (held to max_rel's limit) loosened: the reference is exact here
    loose = G.DEFAULT_GOLDEN.replace(rmse_ratio=1e9, mean_rel_ratio=1e9, max_rel_ratio=1e9)
    leaf = G.judge_golden_tensors(one_wrong, e, g, loose)
    assert leaf.target.small_share == 0.25
    assert leaf.ratios["small_share"] == pytest.approx(1.0)  # 0.25 / max(ref share, 1/4)
    assert leaf.passed
    three_wrong = e.clone()
    three_wrong[:3] += 5e-9
    leaf = G.judge_golden_tensors(three_wrong, e, g, loose)
    assert leaf.ratios["small_share"] == pytest.approx(3.0)
    assert leaf.over_limit == {"small_share": pytest.approx(3.0)}


def test_small_values_are_left_out_of_relative_errors():
    g = f64(1e-9, 1.0)
    e = f32(1e-9, 1.0 + 2 ** -10)
    a = f32(3e-9, 1.0 + 2 ** -10)  # triples the tiny value: relative error 2, but it is "small"
    leaf = G.judge_golden_tensors(a, e, g, G.DEFAULT_GOLDEN.replace(small_value_ratio=1e9))
    assert leaf.ratios["max_rel"] == 1.0 and leaf.ratios["mean_rel"] == 1.0
    assert leaf.target.small_share == 1.0


def test_bf16_recipe_uses_bf16_small_value_thresholds():
    policy = G.default_golden_for_recipe("bf16")
    assert policy.small_values_for(torch.float32) == (1e-3, 1e-5)
    assert G.default_golden_for_recipe("fp32").small_values_for(torch.float32) == (1e-6, 1e-9)
    assert G.DEFAULT_GOLDEN.small_values_for(torch.bfloat16) == (1e-3, 1e-5)  # by leaf dtype when unset


def test_nan_on_one_side_only_fails_and_same_nan_is_ignored():
    g = f64(1.0, 2.0, 3.0)
    e = f32(1.0, math.nan, 3.0)
    a = f32(1.0, 2.0, 3.0)
    leaf = G.judge_golden_tensors(a, e, g, G.DEFAULT_GOLDEN)
    assert leaf.nonfinite_mismatched == 1 and not leaf.passed
    both = G.judge_golden_tensors(e.clone(), e, g, G.DEFAULT_GOLDEN)
    assert both.nonfinite_mismatched == 0 and both.passed
    inf_vs_ninf = G.judge_golden_tensors(f32(math.inf), f32(-math.inf), f64(1.0), G.DEFAULT_GOLDEN)
    assert not inf_vs_ninf.passed


def test_integer_leaves_are_exact():
    e = torch.tensor([1, 2, 3])
    assert G.judge_golden_tensors(e.clone(), e, e, G.DEFAULT_GOLDEN).passed
    wrong = G.judge_golden_tensors(torch.tensor([1, 2, 4]), e, e, G.DEFAULT_GOLDEN)
    assert wrong.exact and wrong.mismatched == 1 and not wrong.passed


def test_shape_problems_fail_with_a_message():
    leaf = G.judge_golden_tensors(f32(1.0, 2.0), f32(1.0), f64(1.0), G.DEFAULT_GOLDEN)
    assert "shape mismatch" in leaf.problem and not leaf.passed
    leaf = G.judge_golden_tensors(f32(1.0), f32(1.0), f64(1.0, 2.0), G.DEFAULT_GOLDEN)
    assert "golden shape" in leaf.problem and not leaf.passed


def test_complex_leaves_are_judged_on_real_and_imaginary_parts():
    g = torch.tensor([1 + 1j], dtype=torch.complex128)
    e = torch.tensor([1 + (1 + 2 ** -10) * 1j], dtype=torch.complex64)
    a = torch.tensor([1 + (1 + 2 ** -9) * 1j], dtype=torch.complex64)
    leaf = G.judge_golden_tensors(a, e, g, G.DEFAULT_GOLDEN)
    assert leaf.ratios["max_rel"] == 2.0


# --------------------------------------------------------------------------------------------
# nested outputs, messages, rows


def test_judge_golden_walks_nested_outputs_and_reports_the_failing_leaf():
    a1, e1, g1 = _dyadic(2 ** -10)       # as good as the reference
    a2, e2, g2 = _dyadic(8 * 2 ** -10)   # eight times worse
    result = G.judge_golden({"x": a1, "y": (a2, None)}, {"x": e1, "y": (e2, None)},
                            {"x": g1, "y": (g2, None)}, G.DEFAULT_GOLDEN, name="demo")
    assert [leaf.path for leaf in result.leaves] == ["x", "y[0]"]
    assert not result.passed and [leaf.path for leaf in result.failures] == ["y[0]"]
    message = result.format("recipe fp32")
    assert "Parity check 'demo' failed under the golden policy (recipe fp32)" in message
    assert "output 'y[0]'" in message and "rmse ratio 8 > 2" in message
    assert "target vs reference (informative)" in message


def test_missing_golden_and_missing_leaves_fail():
    a, e, g = _dyadic(0.0)
    result = G.judge_golden({"x": a, "z": a}, {"x": e}, {}, G.DEFAULT_GOLDEN)
    problems = {leaf.path: leaf.problem for leaf in result.leaves}
    assert problems == {"x": "the golden run has no such output", "z": "not in expected output"}
    assert G.judge_golden({"x": None}, {"x": e}, {"x": g}).leaves[0].problem == "actual is None, the other is a tensor"


def test_rows_carry_policy_and_golden_columns():
    a, e, g = _dyadic(3 * 2 ** -10)
    policy = G.DEFAULT_GOLDEN.replace(source="marker", reason="bf16 kernel")
    row = G.judge_golden({"y": a}, {"y": e}, {"y": g}, policy).leaves[0].to_row()
    json.dumps(row)
    assert row["policy"] == "golden" and row["verdict"] == "fail"
    assert row["golden_rmse_ratio"] == 3.0 and row["golden_dtype"] == "float64"
    assert row["golden_policy_source"] == "marker" and row["golden_policy_reason"] == "bf16 kernel"
    assert row["golden_worst_metric"] in ("rmse", "mean_rel") and row["golden_worst_margin"] == 1.5
    assert "[marker: bf16 kernel]" in row["golden_policy"]


def test_informative_metrics_use_the_given_tolerance():
    a, e, g = _dyadic(2 ** -9)
    leaf = G.judge_golden_tensors(a, e, g, G.DEFAULT_GOLDEN, tolerance=Tolerance(rtol=0, atol=1e-1))
    assert leaf.mismatched == 0 and leaf.tolerance.atol == 1e-1
    leaf = G.judge_golden_tensors(a, e, g, G.DEFAULT_GOLDEN)
    assert leaf.mismatched == 1  # 2**-10 apart: beyond fp32's 1e-5 default


# --------------------------------------------------------------------------------------------
# the policy object


@pytest.mark.parametrize("field", ["rmse_ratio", "max_rel_ratio", "mean_rel_ratio", "small_value_ratio"])
def test_ratio_limits_below_one_are_rejected(field):
    with pytest.raises(ValueError, match=field):
        G.GoldenPolicy(**{field: 0.5})
    with pytest.raises(ValueError, match=field):
        G.GoldenPolicy(**{field: math.nan})


def test_bad_source_and_threshold_are_rejected():
    with pytest.raises(ValueError, match="source"):
        G.GoldenPolicy(source="env")
    with pytest.raises(ValueError, match="small_value_atol"):
        G.GoldenPolicy(small_value_atol=-1.0)


def test_defaults_are_msprobes_error_thresholds():
    assert G.DEFAULT_GOLDEN.limits == {"rmse": 2.0, "max_rel": 10.0, "mean_rel": 2.0, "small_share": 2.0,
                                       "max_abs": 10.0}  # ours: at max_rel's limit


def test_parse_golden_spec():
    policy = G.parse_golden_spec("golden rmse=3, max_rel=20 small_value_threshold=1e-4 # noisy kernel", source="ini")
    assert (policy.rmse_ratio, policy.max_rel_ratio, policy.mean_rel_ratio) == (3.0, 20.0, 2.0)
    assert policy.small_value_threshold == 1e-4
    assert (policy.source, policy.reason) == ("ini", "noisy kernel")
    assert policy.is_override and "[ini: noisy kernel]" in policy.describe()
    with pytest.raises(ValueError, match=r"bad golden policy item 'rtol=1'"):
        G.parse_golden_spec("rtol=1", source="ini")
    with pytest.raises(ValueError, match=r"bad number 'x' for rmse"):
        G.parse_golden_spec("rmse=x", source="marker")
    with pytest.raises(ValueError, match=r"must be >= 1 .*in 'rmse=0.5'"):
        G.parse_golden_spec("rmse=0.5", source="check")


def test_golden_dtype_per_recipe():
    assert G.golden_dtype("fp32") == torch.float64 and G.golden_dtypes("fp32") == (torch.float64,)
    assert G.golden_dtype("bf16") == torch.float64
    assert G.golden_dtypes("bf16") == (torch.float64, torch.float32)  # fp32 where fp64 cannot run
    with pytest.raises(ValueError, match="unknown recipe 'int8'"):
        G.golden_dtype("int8")


# --------------------------------------------------------------------------------------------
# the golden runner


def test_runner_computes_a_linear_in_float64():
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8)
    out = G.GoldenRunner().run(layer, (x,), recipe="fp32")
    expected = x.double() @ layer.weight.double().T + layer.bias.double()
    assert out[""].dtype == torch.float64
    assert torch.equal(out[""], expected)
    assert layer.weight.dtype == torch.float32  # the module itself is untouched


def test_runner_for_bf16_work_is_fp64_else_the_fp32_module_itself():
    layer = torch.nn.Linear(4, 4)
    runner = G.GoldenRunner()
    assert runner.run(layer, (torch.ones(1, 4),), recipe="bf16")[""].dtype == torch.float64
    out = runner.run(layer, (torch.ones(1, 4),), recipe="bf16", dtype=torch.float32)
    assert out[""].dtype == torch.float32
    assert torch.equal(out[""], layer(torch.ones(1, 4)).detach())
    # A computation that cannot give fp64 gets its fp32 golden for bf16 work (and none for fp32 work).
    assert runner.run(_ReturnsFloat32(), (torch.ones(2),), recipe="bf16")[""].dtype == torch.float32
    with pytest.raises(G.GoldenUnavailableError):
        runner.run(_ReturnsFloat32(), (torch.ones(2),), recipe="fp32")


class _HardCodedFloat32(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(torch.ones(x.shape, dtype=torch.float32))


class _ReturnsFloat32(torch.nn.Module):
    def forward(self, x):
        return x.float()


def test_runner_reports_computations_that_cannot_run_in_the_golden_dtype():
    with pytest.raises(G.GoldenUnavailableError, match="float64 golden run failed: RuntimeError"):
        G.GoldenRunner().run(_HardCodedFloat32(), (torch.ones(2, 4),), recipe="fp32")
    with pytest.raises(G.GoldenUnavailableError, match=r"returned float32 for '<output>' instead of float64"):
        G.GoldenRunner().run(_ReturnsFloat32(), (torch.ones(2),), recipe="fp32")


def test_runner_shims_are_entered_with_the_golden_dtype():
    seen = []

    import contextlib

    @contextlib.contextmanager
    def shim(dtype):
        seen.append(dtype)
        yield

    G.GoldenRunner(shims=shim).run(torch.nn.Identity(), (torch.ones(2),), recipe="fp32")
    assert seen == [torch.float64]


def test_runner_shares_one_copy_of_the_root_and_restores_the_default_dtype():
    root = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)).eval()
    runner = G.GoldenRunner(root=root)
    runner.run(root, (torch.ones(1, 4),), recipe="fp32")
    first = runner._copy(root[1], torch.float64)
    assert first is runner._copy(root, torch.float64)[1]
    assert first.weight.dtype == torch.float64 and root[1].weight.dtype == torch.float32
    assert torch.get_default_dtype() == torch.float32
    root.train()  # training mode: BatchNorm statistics would change, so every run gets a fresh copy
    assert runner._copy(root[1], torch.float64) is not runner._copy(root[1], torch.float64)


def test_runner_copies_a_submodule_alone_until_the_root_is_copied():
    """A live golden of one small submodule copies that submodule, not the whole model; once the root
    has its copy, submodules come from it and their own copies are dropped. The golden is the same
    either way."""
    root = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 64), torch.nn.Linear(64, 4)).eval()
    runner = G.GoldenRunner(root=root)
    x = torch.randn(3, 4)
    alone = runner.run(root[0], (x,), recipe="fp32")[""]
    assert torch.float64 not in runner._root_copies  # the model was not copied for it
    own = runner._copy(root[0], torch.float64)
    assert own is runner._copy(root[0], torch.float64)  # cached
    assert own.weight.dtype == torch.float64 and own.weight is not root[0].weight
    runner.run(root, (x,), recipe="fp32")  # a golden of the root itself: now the one shared copy
    root_copy = runner._root_copies[torch.float64]
    assert runner._copy(root[0], torch.float64) is root_copy[0]
    assert torch.float64 not in runner._copies.get(root[0], {})  # the submodule's own copy is dropped
    assert torch.equal(runner.run(root[0], (x,), recipe="fp32")[""], alone)


def test_runner_dropout_masks_match_the_fp32_run():
    """The float64 golden of a training-mode module drops the same elements as the fp32 side."""
    from pytest_npu_parity.rng import same_randomness

    module = torch.nn.Dropout(0.5).train()
    x = torch.ones(64)
    with same_randomness(7):
        side = module(x)
    gold = G.GoldenRunner().run(module, (x,), recipe="fp32", seed=7)[""]
    assert torch.equal(gold == 0, side == 0)
    assert torch.equal(gold, side.double())


def test_floating_dtypes_may_differ_and_the_floor_uses_the_coarser_one():
    g = f64(1.0 / 3.0, 2.0 / 3.0)
    e = g.to(torch.float32)             # reference kept fp32 (e.g. one autocast kernel)
    a = g.to(torch.bfloat16)            # target returned bf16 (another kernel), correctly rounded
    leaf = G.judge_golden_tensors(a, e, g, G.DEFAULT_GOLDEN)
    assert leaf.problem is None and leaf.passed
    assert "target bfloat16, reference float32" in leaf.note
    assert leaf.ratios["rmse"] == pytest.approx(1.0)  # the target is exactly at the bf16 rounding floor
    assert (leaf.dtype, leaf.expected_dtype) == ("bfloat16", "float32")
    assert G.judge_golden_tensors(torch.tensor([1, 2]), f32(1.0, 2.0), f64(1.0, 2.0),
                                  G.DEFAULT_GOLDEN).problem.startswith("dtype mismatch")


def test_bf16_work_floors_fp32_outputs_at_bf16_rounding():
    # An op autocast keeps in fp32 (layer_norm): the fp32 reference equals the fp32 golden, a correct
    # target differs by 1e-6. Floor in the leaf's dtype: 0.3's fp32 rounding only (rmse 1.19e-8/2),
    # so the ratio explodes; floor in bf16: 0.3 -> 0.30078125 (error 7.8125e-4, rmse 3.90625e-4).
    # (Only where the golden is no finer than the output: an fp32 golden, fp64 being unavailable.)
    g = torch.tensor([1.0, 1.5, 3.0, 0.3], dtype=torch.float32)
    e = g.clone()
    a = e + 1e-6
    policy = G.default_golden_for_recipe("bf16")
    strict = G.judge_golden_tensors(a, e, g, policy)
    assert not strict.passed and strict.ratios["rmse"] == math.inf
    floored = G.judge_golden_tensors(a, e, g, policy, work_dtype=torch.bfloat16)
    bf16_error = 0.30078125 - float(g[3])  # 0.3f rounds to 0.30078125 in bf16
    assert floored.floor.rmse == pytest.approx(bf16_error / 2, rel=1e-9)
    assert floored.ratios["rmse"] == pytest.approx(floored.target.rmse / (bf16_error / 2), rel=1e-9)
    assert floored.passed and floored.ratios["rmse"] < 0.01
    # An fp64 golden is finer than the fp32 output: the floor stays fp32 rounding (msprobe's rule).
    g64 = torch.tensor([1.0, 1.5, 3.0, 0.3], dtype=torch.float64)
    finer = G.judge_golden_tensors(g64.float() + 1e-6, g64.float(), g64, policy, work_dtype=torch.bfloat16)
    assert finer.floor.rmse == pytest.approx(abs(float(torch.tensor(0.3).double()) - 0.3) / 2, rel=1e-6)
    assert not finer.passed


def test_fp32_work_refuses_a_dtype_change_bf16_work_allows_it():
    g = torch.linspace(-1, 1, 64, dtype=torch.float64)
    e, a = g.float(), g.to(torch.bfloat16)
    fp32 = G.judge_golden_tensors(a, e, g, G.default_golden_for_recipe("fp32"), work_dtype=torch.float32)
    assert not fp32.passed and "dtype mismatch" in fp32.problem
    bf16 = G.judge_golden_tensors(a, e, g, G.default_golden_for_recipe("bf16"), work_dtype=torch.bfloat16)
    assert bf16.problem is None and "dtype differs" in bf16.note


def test_golden_spec_shares_the_tolerance_spec_syntax():
    # policy.parse_spec_items: spaces around '=', aliases of one field counted once.
    assert G.parse_golden_spec("golden rmse = 3, max_rel=20", source="ini").rmse_ratio == 3
    with pytest.raises(ValueError, match="given twice"):
        G.parse_golden_spec("rmse=3 rmse_ratio=4", source="ini")


def test_golden_does_not_import_the_runner():
    """golden needs only the owner-module helper: importing it must not pull in runner (no import circle)."""
    import subprocess
    import sys

    code = ("import sys, pytest_npu_parity.golden; "
            "sys.exit(1 if 'pytest_npu_parity.runner' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_the_all_finite_block_path_gives_bitwise_the_masked_paths_metrics():
    from pytest_npu_parity.golden import _SideSums

    gen = torch.Generator().manual_seed(5)
    g = torch.randn(10000, generator=gen, dtype=torch.float64)
    g[::97] *= 1e-8  # some small golden values
    x = g + 1e-7 * torch.randn(10000, generator=gen, dtype=torch.float64)
    for threshold in (1e-6, 0.0, 10.0):  # some small, none small, all small
        fast, masked = _SideSums(), _SideSums()
        small = g.abs() < threshold
        fast.add(x, g, torch.ones_like(small), small, 1e-9)  # every position finite: the fast path
        # the same block and one NaN position: the masked path over the same finite elements
        x2, g2 = torch.cat([x, torch.tensor([math.nan], dtype=torch.float64)]), torch.cat([g, torch.ones(1).double()])
        mask2 = torch.isfinite(x2)
        masked.add(x2, g2, mask2, mask2 & (g2.abs() < threshold), 1e-9)
        assert fast.result() == masked.result() and fast.n == masked.n == 10000


# --------------------------------------------------------------------------------------------
# small leaves judged together (judge_golden's batched path)


def _small_leaves(seed: int) -> tuple[dict, dict, dict]:
    """Target, reference and golden outputs of many small leaves: sizes from 0 to past ``SMALL_LEAF``
    and over several ``WORKER_BLOCK`` batches, small golden values, NaN/Inf where both sides agree, a
    golden beyond bf16's range, a complex leaf, a leaf whose target dtype differs, an integer leaf."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [0, 1, 2, 7, 64, 300, 1000, 4096, G.SMALL_LEAF, G.SMALL_LEAF + 1] + [G.SMALL_LEAF] * 10
    actual, expected, golden = {}, {}, {}
    for i, n in enumerate(sizes):
        g = torch.randn(n, generator=gen, dtype=torch.float64) * 10.0 ** (i % 5 - 2)
        g[::13] *= 1e-7  # small golden values
        e = (g + 1e-7 * torch.randn(n, generator=gen, dtype=torch.float64)).float()
        a = (g + 1.5e-7 * torch.randn(n, generator=gen, dtype=torch.float64)).float()
        if n > 10:
            for t in (a, e):
                t[3], t[5] = math.nan, math.inf  # the same on both sides: left out of the metrics
            g[9] = 1e40  # beyond bf16's and fp32's range: the floor leaves it out
        actual[f"w{i}"], expected[f"w{i}"], golden[f"w{i}"] = a, e, g
    g = torch.randn(50, generator=gen, dtype=torch.complex128)
    actual["c"], expected["c"], golden["c"] = (g + 1e-6).to(torch.complex64), g.to(torch.complex64), g
    g = torch.randn(40, generator=gen, dtype=torch.float64)
    actual["mixed"], expected["mixed"], golden["mixed"] = g.to(torch.bfloat16), g.float(), g
    actual["steps"] = expected["steps"] = golden["steps"] = torch.arange(5)
    return actual, expected, golden


@pytest.mark.parametrize("recipe", ["fp32", "bf16"])
def test_small_leaves_judged_together_match_the_leaf_by_leaf_verdict(recipe):
    actual, expected, golden = _small_leaves(3)
    policy = G.default_golden_for_recipe(recipe)
    work = torch.bfloat16 if recipe == "bf16" else None
    together = G.judge_golden(actual, expected, golden, policy, work_dtype=work).leaves
    assert [leaf.path for leaf in together] == list(expected)
    for leaf in together:
        alone = G.judge_golden_tensors(actual[leaf.path], expected[leaf.path], golden[leaf.path], policy,
                                       path=leaf.path, work_dtype=work)
        assert ((leaf.passed, leaf.problem, leaf.exact, leaf.note)
                == (alone.passed, alone.problem, alone.exact, alone.note))
        if alone.exact:
            continue
        for side in ("target", "reference", "floor"):
            mine, theirs = getattr(leaf, side), getattr(alone, side)
            assert (mine.small, mine.normal) == (theirs.small, theirs.normal), (leaf.path, side)
            for metric in ("rmse", "max_rel", "mean_rel", "small_share", "balance"):
                assert getattr(mine, metric) == pytest.approx(getattr(theirs, metric), rel=1e-12, abs=0), \
                    (leaf.path, side, metric)
        assert leaf.ratios == pytest.approx(alone.ratios, rel=1e-12, nan_ok=True), leaf.path


@pytest.mark.parametrize("planted", ["w1", "w5", "w8", "w15", "c"])
def test_a_fault_in_one_small_leaf_fails_that_leaf_only(planted):
    _, expected, golden = _small_leaves(4)
    actual = {path: e.clone() for path, e in expected.items()}  # the reference's own errors: every ratio 1
    policy = G.default_golden_for_recipe("fp32")
    assert G.judge_golden(actual, expected, golden, policy).passed
    g = golden[planted]
    actual[planted] = (g + 1e-3 * g.abs().clamp(min=1e-3)).to(actual[planted].dtype)  # far worse than the reference
    result = G.judge_golden(actual, expected, golden, policy)
    assert [leaf.path for leaf in result.failures] == [planted]


def test_only_leaves_larger_than_small_leaf_are_judged_one_by_one(monkeypatch):
    from pytest_npu_parity.judge import golden as judge

    alone = []
    real = judge._judge_ratios
    monkeypatch.setattr(judge, "_judge_ratios", lambda leaf, *rest: alone.append(leaf.path) or real(leaf, *rest))
    actual, expected, golden = _small_leaves(5)
    result = judge.judge_golden(actual, expected, golden, G.default_golden_for_recipe("fp32"))
    assert all(leaf.target is not None for leaf in result.leaves if not leaf.exact)
    assert alone == ["w9"]  # the one leaf of SMALL_LEAF + 1 elements


@pytest.mark.parametrize("size", [3, G.SMALL_LEAF + 5])  # judged together, and alone
def test_a_zero_golden_counted_as_normal_gives_nan_relative_errors_on_both_paths(size):
    # small_value_threshold=0: a golden of exactly 0 is "normal", and an equal value's relative error
    # is 0/0. max_rel is NaN leaf by leaf as together (it was 0 leaf by leaf: Python's max dropped the
    # NaN), and the leaf fails: its ratios are NaN.
    policy = G.parse_policy_spec("golden small_value_threshold=0 # zero golden", source="marker", recipe="fp32")
    g = torch.linspace(0, 2, size, dtype=torch.float64)  # g[0] == 0
    e = g.float()
    together = G.judge_golden({"x": e.clone()}, {"x": e}, {"x": g}, policy).leaves[0]
    alone = G.judge_golden_tensors(e.clone(), e, g, policy, path="x")
    for leaf in (together, alone):
        assert math.isnan(leaf.target.max_rel) and math.isnan(leaf.reference.max_rel)
        assert not leaf.passed


def test_a_golden_of_another_shape_leaves_a_value_dependent_output_to_the_floor():
    """``y[y > t]``: the float64 golden selected 6 elements, both bf16 sides the same 5 (the 6th, near t, fell below).
    No ratio can be taken; under the floor it decides (a correct target failed on the golden's shape before),
    without the floor the leaf fails as before."""
    g = torch.tensor([0.31, 0.5, 0.7, 0.9, 1.1, 0.3004], dtype=torch.float64)
    e = g[:5].to(torch.bfloat16)
    fine = G.judge_golden_tensors(e.clone(), e, g, _FLOOR, tolerance=LOW_PRECISION, path="y", work_dtype=torch.bfloat16)
    assert fine.passed and fine.golden_shape == (6,) and "value-dependent shape" in fine.note
    off = G.judge_golden_tensors(e * 1.01, e, g, _FLOOR, tolerance=LOW_PRECISION, path="y", work_dtype=torch.bfloat16)
    assert not off.passed and off.golden_shape == (6,)
    message = G.judge_golden({"y": e * 1.01}, {"y": e}, {"y": g}, _FLOOR, tolerance=LOW_PRECISION,
                             work_dtype=torch.bfloat16, name="select").format()
    assert "outside the allclose floor" in message and "the golden's shape (6,) differs from the outputs' (5,)" in message
    plain = G.judge_golden_tensors(e.clone(), e, g, _FLOOR.replace(allclose_floor=False),
                                   tolerance=LOW_PRECISION, path="y", work_dtype=torch.bfloat16)
    assert not plain.passed and plain.problem == "golden shape (6,) differs from the outputs' (5,)"
    # only a first dimension of another length is a value-dependent shape: a transposed golden, or one of another
    # rank, is a golden of something else
    square = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for golden in (square.T, square.reshape(-1), square[None]):
        other = G.judge_golden_tensors(square.to(torch.bfloat16), square.to(torch.bfloat16), golden, _FLOOR,
                                       tolerance=LOW_PRECISION, path="y", work_dtype=torch.bfloat16)
        assert not other.passed and other.golden_shape is None and other.problem.startswith("golden shape")


def test_a_golden_of_another_length_holds_the_budget_to_the_gross_bound():
    """With no golden to vouch for an element, the floor takes the budget's outliers only within 16x the bound:
    the sign flip at 0.04 (77x) that the gross test fails where the golden has the outputs' shape fails here too."""
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(64, 64, dtype=torch.float64, generator=gen)
    e, a = _two_bf16_kernels(g, gen)
    longer = torch.cat([g.reshape(-1), g.new_ones(1)])  # the golden selected one element more
    judge = lambda x: G.judge_golden_tensors(x.reshape(-1), e.reshape(-1), longer, _FLOOR,  # noqa: E731
                                             tolerance=LOW_PRECISION, path="y", work_dtype=torch.bfloat16)
    assert judge(a).passed and judge(a).golden_shape == (4097,)
    i = int((g.abs() - 0.04).abs().argmin())
    flipped = judge(_negated(a, torch.tensor([i])))
    assert 0 < flipped.mismatched <= flipped.allowed and G.GROSS_ERR_RATIO < flipped.err_ratio <= 100
    assert not flipped.passed
    message = G.judge_golden({"y": _negated(a, torch.tensor([i])).reshape(-1)}, {"y": e.reshape(-1)}, {"y": longer},
                             _FLOOR, tolerance=LOW_PRECISION, work_dtype=torch.bfloat16, name="select").format()
    assert "each within 16x it" in message and "a value-dependent shape" in message


def test_amp_scale_is_compared_exactly_under_fp16_work_only():
    """The loss scaler's scale after an fp16 step is a power of two the overflow decisions set: compared exactly
    (a target that missed the overflow kept the golden step's own 2^16); any other leaf of that name, in
    another recipe, keeps the ratio test."""
    scale = torch.tensor(2.0 ** 15)
    missed = G.judge_golden_tensors(scale * 2, scale, torch.tensor(2.0 ** 16, dtype=torch.float64), _FLOOR,
                                    path="amp.scale", work_dtype=torch.float16)
    assert missed.exact and not missed.passed
    header = G.judge_golden({"amp.scale": scale * 2}, {"amp.scale": scale}, {"amp.scale": scale.double() * 2}, _FLOOR,
                            work_dtype=torch.float16, name="step").format()
    assert "output 'amp.scale': 1 element(s) differ, compared exactly" in header
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(64, 64, dtype=torch.float64, generator=gen)
    e, a = _two_bf16_kernels(g, gen)
    own = G.judge_golden_tensors(a, e, g, _FLOOR, tolerance=LOW_PRECISION, path="amp.scale", work_dtype=torch.bfloat16)
    assert not own.exact and own.passed
