"""Agreement of ``compare.MsprobeView`` with msprobe 26.2.0's own dump compare, column by column, on a
spread of tensor pairs (random fp32/bf16/fp16/fp64, zeros in the reference, values near the
small-value thresholds, NaN/±Inf in every arrangement, empty, 0-d, 1-element, 10 M elements).

Every expected number is computed by msprobe itself (``msprobe_ref.dump_compare``); the tests skip
only when msprobe is not installed.
"""
from __future__ import annotations

import math

import pytest
import torch

from pytest_npu_parity.compare import MSPROBE_COLUMNS, MsprobeView, compare_tensors
from pytest_npu_parity.policy import default_for_dtype

from msprobe_ref import dump_compare, require_msprobe

NAN, INF = math.nan, math.inf


def _pair(dtype: torch.dtype, n: int = 1000, noise: float = 1e-3, seed: int = 0, shape=None):
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(n, generator=g, dtype=torch.float64)
    a = e * (1 + noise * torch.randn(n, generator=g, dtype=torch.float64))
    shape = shape or (n,)
    return a.to(dtype).reshape(shape), e.to(dtype).reshape(shape)


def _with(pair, a_at=None, e_at=None):
    a, e = (t.clone() for t in pair)
    for t, changes in ((a, a_at), (e, e_at)):
        for i, v in (changes or {}).items():
            t.view(-1)[i] = v
    return a, e


def _near_small(dtype: torch.dtype, threshold: float):
    a, e = _pair(torch.float64, 2000, noise=1e-2, seed=3)
    scale = torch.linspace(0.25, 4.0, 2000, dtype=torch.float64) * threshold
    return (a * scale).to(dtype), (e * scale).to(dtype)


def _cases():
    f32 = _pair(torch.float32)
    cases = {
        "random fp32": f32,
        "random fp32, 1e-6 noise": _pair(torch.float32, noise=1e-6, seed=1),
        "random bf16": _pair(torch.bfloat16, noise=1e-2, seed=2),
        "random fp16": _pair(torch.float16, noise=1e-3, seed=4),
        "random fp64": _pair(torch.float64, noise=1e-9, seed=5),
        "2-d fp32 3x5": _pair(torch.float32, 15, seed=6, shape=(3, 5)),
        "squeezed 1x1x7": _pair(torch.float32, 7, seed=7, shape=(1, 1, 7)),
        "zeros in the reference": _with(f32, a_at={3: 0.0, 5: 1e-30}, e_at={3: 0.0, 4: 0.0, 5: 0.0, 6: 0.0}),
        "bf16 zeros in the reference": _with(_pair(torch.bfloat16, seed=8), e_at={0: 0.0, 9: 0.0}),
        "fp16 zeros in the reference": _with(_pair(torch.float16, seed=9), e_at={1: 0.0}),
        "reference all zero": (f32[0], torch.zeros(1000)),
        "target all zero": (torch.zeros(1000), f32[1]),
        "both all zero": (torch.zeros(1000), torch.zeros(1000)),
        "tiny norms": (torch.full((4,), 1e-17, dtype=torch.float64), torch.full((4,), 2e-17, dtype=torch.float64)),
        "near 2^-10, bf16": _near_small(torch.bfloat16, 2.0 ** -10),
        "near 2^-10, fp16": _near_small(torch.float16, 2.0 ** -10),
        "near 2^-20, fp32": _near_small(torch.float32, 2.0 ** -20),
        "NaN on one side": _with(f32, a_at={10: NAN}),
        "NaN at the same place": _with(f32, a_at={10: NAN, 20: NAN}, e_at={10: NAN, 20: NAN}),
        "+Inf at the same place": _with(f32, a_at={7: INF}, e_at={7: INF}),
        "-Inf vs +Inf": _with(f32, a_at={7: -INF}, e_at={7: INF}),
        "Inf vs NaN": _with(f32, a_at={7: INF}, e_at={7: NAN}),
        "Inf on one side": _with(f32, e_at={8: -INF}),
        "NaN and Inf matched, bf16": _with(_pair(torch.bfloat16, seed=10), a_at={1: NAN, 2: -INF}, e_at={1: NAN, 2: INF}),
        "equal tensors": (f32[1], f32[1].clone()),
        "equal with Inf": _with((f32[1], f32[1].clone()), a_at={0: INF}, e_at={0: INF}),
        "empty": (torch.empty(0), torch.empty(0)),
        "empty 2-d": (torch.empty(3, 0), torch.empty(3, 0)),
        "0-d": (torch.tensor(1.5), torch.tensor(1.25)),
        "0-d, zero reference": (torch.tensor(1e-3), torch.tensor(0.0)),
        "0-d fp16": (torch.tensor(1.001, dtype=torch.float16), torch.tensor(1.0, dtype=torch.float16)),
        "0-d bf16 NaN": (torch.tensor(NAN, dtype=torch.bfloat16), torch.tensor(1.0, dtype=torch.bfloat16)),
        "1-element": (torch.tensor([3.0]), torch.tensor([2.0])),
        "1-element, Inf on one side": (torch.tensor([INF]), torch.tensor([2.0])),
        "2-element": (torch.tensor([1.0, 2.0]), torch.tensor([1.0005, 2.02])),
        "int64": (torch.tensor([1, 2, 3, 0, 5]), torch.tensor([1, 2, 4, 0, 0])),
        "fp32 overflowing difference": (torch.tensor([3e38, 1.0]), torch.tensor([-3e38, 1.0])),
        "fp32 subnormal reference": (torch.tensor([1e-30, 1.0, 2.0]), torch.tensor([1e-44, 1.0, 2.0])),
    }
    return cases


CASES = _cases()


def _agree(ours: object, theirs: object) -> bool:
    if isinstance(theirs, str):
        return ours == theirs
    theirs = float(theirs)
    if not isinstance(ours, float):
        return False
    if math.isnan(theirs) or math.isinf(theirs):
        return ours == theirs or (math.isnan(ours) and math.isnan(theirs))
    return math.isclose(ours, theirs, rel_tol=1e-6, abs_tol=0.0)


def _view(a: torch.Tensor, e: torch.Tensor) -> MsprobeView:
    leaf = compare_tensors(a, e, default_for_dtype(e.dtype))
    assert leaf.msprobe is not None
    return leaf.msprobe


@pytest.mark.parametrize("case", list(CASES))
def test_every_column_equals_msprobe(case):
    require_msprobe()
    a, e = CASES[case]
    ours, theirs = _view(a, e).as_dict(), dump_compare(a, e)
    differ = {c: (ours[c], theirs[c]) for c in MSPROBE_COLUMNS if not _agree(ours[c], theirs[c])}
    assert not differ, f"{case}: ours vs msprobe {differ}"


def test_ten_million_elements_equal_msprobe():
    require_msprobe()
    a, e = _pair(torch.float32, 10_000_000, noise=2e-3, seed=11)
    e[::1000] = 0.0
    a[5] = NAN
    e[5] = NAN
    ours, theirs = _view(a, e).as_dict(), dump_compare(a, e)
    assert all(_agree(ours[c], theirs[c]) for c in MSPROBE_COLUMNS), (ours, theirs)
    assert ours["one_thousandth"] < ours["five_thousandths"] < 1.0  # the counts were exercised


def test_agreement_count_over_the_spread():
    """Every cell of every pair agrees: 6 columns x the pairs above."""
    require_msprobe()
    cells = agree = 0
    for a, e in CASES.values():
        ours, theirs = _view(a, e).as_dict(), dump_compare(a, e)
        cells += len(MSPROBE_COLUMNS)
        agree += sum(_agree(ours[c], theirs[c]) for c in MSPROBE_COLUMNS)
    assert agree == cells == 6 * len(CASES)


# Known answers that do not need msprobe installed: each was checked against msprobe 26.2.0 by the
# tests above (the same pairs), and pins the conventions where msprobe differs from our metrics.

def test_view_conventions_differ_from_our_metrics():
    a, e = _with(_pair(torch.float32, 100), a_at={0: 0.5}, e_at={0: 0.0, 1: -INF}, )
    a.view(-1)[1] = INF
    leaf = compare_tensors(a, e, default_for_dtype(torch.float32))
    # ours: -Inf vs +Inf is a mismatch; msprobe: equal Inf masks, zeroed, numbers as usual
    assert leaf.nonfinite_mismatched == 1 and not leaf.passed
    assert isinstance(leaf.msprobe.cosine, float)
    # ours divides by |e| + 1e-10, msprobe by float32 eps where e == 0
    assert leaf.max_rel == pytest.approx(0.5 / 1e-10)
    assert leaf.msprobe.max_rel_err == pytest.approx(0.5 / 2.0 ** -23, rel=1e-6)


def test_view_markers():
    assert _view(torch.empty(0), torch.empty(0)) == MsprobeView.all("unsupported", "empty tensor")
    nan_one_side = _view(*_with(_pair(torch.float32, 10), a_at={0: NAN}))
    assert set(nan_one_side.as_dict().values()) == {"N/A"}
    one = _view(torch.tensor([3.0]), torch.tensor([2.0]))
    assert (one.cosine, one.euc_dist, one.one_thousandth) == ("unsupported",) * 3
    assert (one.max_abs_err, one.max_rel_err) == (1.0, 0.5)
    assert _view(torch.zeros(5), torch.ones(5)).cosine == "Nan"
    assert _view(torch.zeros(5), torch.zeros(5)).cosine == 1.0


def test_view_rounds_like_msprobe():
    a, e = _pair(torch.float32, 1000, noise=1e-4, seed=12)
    view = _view(a, e)
    assert view.cosine == round(view.cosine, 6)  # above 0.9999: six decimals
    assert view.max_abs_err == float(f"{view.max_abs_err:.12f}")


def test_view_in_row_and_complex_has_none():
    a, e = _pair(torch.float32, 10)
    row = compare_tensors(a, e, default_for_dtype(torch.float32)).to_row()
    assert {f"msprobe_{c}" for c in MSPROBE_COLUMNS} <= set(row) and row["msprobe_note"] is None
    row0 = compare_tensors(torch.tensor(1.0), torch.tensor(2.0), default_for_dtype(torch.float32)).to_row()
    assert row0["msprobe_cosine"] is None and row0["msprobe_note"].startswith("cosine=unsupported")
    z = torch.complex(a, e)
    assert compare_tensors(z, z * 1.001, default_for_dtype(torch.complex64)).msprobe is None
