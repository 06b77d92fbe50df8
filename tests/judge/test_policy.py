"""Tests of pytest_npu_parity.policy: Tolerance validation, defaults per dtype and recipe, spec parsing."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pytest_npu_parity.policy import (
    BF16_BUDGET,
    EXACT,
    FP32,
    FP64,
    LOW_PRECISION,
    SOURCES,
    Tolerance,
    default_for_dtype,
    default_for_recipe,
    parse_tolerance_spec,
)


# --------------------------------------------------------------------------------------------
# Tolerance


def test_defaults_are_the_required_values():
    assert (FP32.rtol, FP32.atol, FP32.budget) == (1e-5, 1e-5, 0.0)
    assert (LOW_PRECISION.rtol, LOW_PRECISION.atol, LOW_PRECISION.budget) == (1e-3, 1e-3, BF16_BUDGET)
    assert BF16_BUDGET == 1e-3
    assert (EXACT.rtol, EXACT.atol, EXACT.budget) == (0.0, 0.0, 0.0)
    assert all(t.source == "default" and t.reason is None and not t.is_override for t in (FP32, LOW_PRECISION, FP64, EXACT))


@pytest.mark.parametrize("kwargs,message", [
    (dict(rtol=-1e-5, atol=1e-5), "rtol and atol must be finite and >= 0"),
    (dict(rtol=1e-5, atol=-1e-9), "rtol and atol must be finite and >= 0"),
    (dict(rtol=math.nan, atol=1e-5), "rtol and atol must be finite"),
    (dict(rtol=1e-5, atol=math.inf), "rtol and atol must be finite"),
    (dict(rtol=1e-5, atol=1e-5, budget=-0.1), r"budget is a fraction of elements in \[0, 1\], got -0.1"),
    (dict(rtol=1e-5, atol=1e-5, budget=1.5), r"budget is a fraction of elements in \[0, 1\], got 1.5"),
    (dict(rtol=1e-5, atol=1e-5, budget=math.nan), "budget is a fraction"),
    (dict(rtol=1e-5, atol=1e-5, source="cli"), "unknown tolerance source 'cli'"),
])
def test_tolerance_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Tolerance(**kwargs)


@pytest.mark.parametrize("kwargs,name", [
    (dict(rtol="1e-5", atol=1e-5), "rtol"),
    (dict(rtol=1e-5, atol=None), "atol"),
    (dict(rtol=1e-5, atol=1e-5, budget=True), "budget"),
])
def test_tolerance_rejects_non_numbers(kwargs, name):
    with pytest.raises(TypeError, match=f"{name} must be a number"):
        Tolerance(**kwargs)


def test_tolerance_accepts_ints_and_numpy_numbers_as_floats():
    tol = Tolerance(rtol=0, atol=np.float32(0.5), budget=np.float64(0.25))
    assert (tol.rtol, tol.atol, tol.budget) == (0.0, 0.5, 0.25)
    assert all(type(v) is float for v in (tol.rtol, tol.atol, tol.budget))


def test_budget_edges_are_allowed():
    assert Tolerance(rtol=0, atol=0, budget=0.0).allowed_mismatches(10**6) == 0
    assert Tolerance(rtol=0, atol=0, budget=1.0).allowed_mismatches(7) == 7


@pytest.mark.parametrize("budget,numel,allowed", [
    (1e-3, 999, 0), (1e-3, 1000, 1), (1e-3, 1999, 1), (1e-3, 2000, 2),
    (0.29, 100, 29),  # 0.29 * 100 == 28.999999999999996 in binary
    (0.5, 0, 0), (0.1, 64 * 2**20, 6710886),
])
def test_allowed_mismatches_is_floor_of_budget_times_numel(budget, numel, allowed):
    assert Tolerance(rtol=0, atol=0, budget=budget).allowed_mismatches(numel) == allowed


def test_replace_validates_again_and_keeps_the_rest():
    tol = FP32.replace(atol=1e-4, source="marker", reason="fused kernel")
    assert (tol.rtol, tol.atol, tol.budget, tol.source, tol.reason) == (1e-5, 1e-4, 0.0, "marker", "fused kernel")
    assert tol.is_override and FP32.atol == 1e-5  # frozen original untouched
    with pytest.raises(ValueError):
        FP32.replace(budget=2.0)


def test_describe():
    assert FP32.describe() == "rtol=1e-05 atol=1e-05 budget=0"
    assert LOW_PRECISION.describe() == "rtol=0.001 atol=0.001 budget=0.001"
    assert Tolerance(rtol=1.3e-6, atol=1e-5, source="ini").describe() == "rtol=1.3e-06 atol=1e-05 budget=0 [ini]"
    assert (Tolerance(rtol=1e-4, atol=0, budget=0.01, source="check", reason="split-K on NPU").describe()
            == "rtol=0.0001 atol=0 budget=0.01 [check: split-K on NPU]")


def test_sources_are_ordered_by_precedence():
    assert SOURCES == ("default", "ini", "marker", "check")


# --------------------------------------------------------------------------------------------
# defaults per dtype and recipe


@pytest.mark.parametrize("dtype,expected", [
    (torch.float32, FP32), (torch.complex64, FP32),
    (torch.bfloat16, LOW_PRECISION), (torch.float16, LOW_PRECISION),
    (torch.float64, FP64), (torch.complex128, FP64),
    (torch.int64, EXACT), (torch.int32, EXACT), (torch.uint8, EXACT), (torch.bool, EXACT),
])
def test_default_for_dtype(dtype, expected):
    assert default_for_dtype(dtype) == expected


@pytest.mark.parametrize("recipe,expected", [
    ("fp32", FP32), ("bf16", LOW_PRECISION), ("bf16-weights", LOW_PRECISION), ("fp16", LOW_PRECISION),
])
def test_default_for_recipe(recipe, expected):
    assert default_for_recipe(recipe) == expected


def test_unknown_recipe_names_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown recipe 'fp8'; expected one of \['bf16', 'bf16-weights', 'fp16', 'fp32'\]"):
        default_for_recipe("fp8")


# --------------------------------------------------------------------------------------------
# parse_tolerance_spec


@pytest.mark.parametrize("text,expected", [
    ("rtol=1e-4 atol=2e-4 budget=0.01 # fused attention on NPU", (1e-4, 2e-4, 0.01, "fused attention on NPU")),
    ("rtol=1e-4", (1e-4, 1e-5, 0.0, None)),                   # other keys keep the base's values
    ("atol = 3e-5, budget= 0", (1e-5, 3e-5, 0.0, None)),      # commas and spaces around '='
    ("budget=1", (1e-5, 1e-5, 1.0, None)),
    ("  # only a reason", (1e-5, 1e-5, 0.0, "only a reason")),
    ("", (1e-5, 1e-5, 0.0, None)),
    ("rtol=0 atol=0", (0.0, 0.0, 0.0, None)),
])
def test_parse_good_specs(text, expected):
    tol = parse_tolerance_spec(text, source="ini", base=FP32)
    assert (tol.rtol, tol.atol, tol.budget, tol.reason) == expected
    assert tol.source == "ini"


def test_parse_keeps_the_base_reason_unless_given():
    base = FP32.replace(source="ini", reason="from the ini")
    assert parse_tolerance_spec("atol=1e-4", source="marker", base=base).reason == "from the ini"
    over = parse_tolerance_spec("atol=1e-4 # marker says", source="marker", base=base)
    assert (over.reason, over.source) == ("marker says", "marker")


def test_parse_over_a_recipe_default():
    tol = parse_tolerance_spec("rtol=5e-3", source="ini", base=default_for_recipe("bf16"))
    assert (tol.rtol, tol.atol, tol.budget) == (5e-3, 1e-3, BF16_BUDGET)


@pytest.mark.parametrize("text,message", [
    ("rtol=1e-4 tol=1", r"bad tolerance item 'tol=1' in 'rtol=1e-4 tol=1': expected rtol=, atol= or budget="),
    ("rtol", r"bad tolerance item 'rtol'"),
    ("RTOL=1e-4", r"bad tolerance item 'RTOL=1e-4'"),
    ("rtol=1e-4x", r"bad number '1e-4x' for rtol in 'rtol=1e-4x'"),
    ("atol=", r"bad number '' for atol"),
    ("rtol=1 rtol=2", r"rtol is given twice in 'rtol=1 rtol=2'"),
    ("budget=1.5", r"bad tolerance 'budget=1.5': budget is a fraction of elements in \[0, 1\]"),
    ("atol=-1e-5", r"bad tolerance 'atol=-1e-5': rtol and atol must be finite and >= 0"),
    ("rtol=inf", r"bad tolerance 'rtol=inf'"),
])
def test_parse_bad_specs_say_what_and_where(text, message):
    with pytest.raises(ValueError, match=message):
        parse_tolerance_spec(text, source="ini", base=FP32)


def test_parse_rejects_an_unknown_source():
    with pytest.raises(ValueError, match="unknown tolerance source 'env'"):
        parse_tolerance_spec("rtol=1e-4", source="env", base=FP32)
