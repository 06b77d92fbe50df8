"""Tests of pytest_npu_parity.compare: every metric against a float64 NumPy computation, verdicts on
the tolerance boundary, NaN/Inf parity, nested structures and the failure message."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from pytest_npu_parity.judge import allclose as compare_mod  # the home of BLOCK, _Accumulator …: patch it there
from pytest_npu_parity.compare import (
    REL_EPS,
    CompareResult,
    LeafResult,
    ParityError,
    compare,
    compare_tensors,
    flatten,
)
from pytest_npu_parity.policy import EXACT, FP32, FP64, LOW_PRECISION, Tolerance

NAN, INF = math.nan, math.inf


# --------------------------------------------------------------------------------------------
# the reference: the metrics computed independently with NumPy in float64 / complex128


def _np(t: torch.Tensor) -> np.ndarray:
    """The exact values of ``t`` as float64 (complex128) NumPy, in its logical (row-major) order."""
    t = t.detach().resolve_conj()
    if t.is_complex():
        return t.to(torch.complex128).numpy()
    return t.to(torch.float64).numpy()


def reference_metrics(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> dict:
    a, e = _np(actual).ravel(), _np(expected).ravel()
    shape = tuple(expected.shape)
    finite = np.isfinite(a) & np.isfinite(e)
    same_special = (np.isnan(a) & np.isnan(e)) | (~np.isfinite(a) & (a == e))
    bad_special = ~finite & ~same_special
    a0, e0 = np.where(finite, a, 0), np.where(finite, e, 0)
    d = np.abs(a0 - e0)
    allowed = atol + rtol * np.abs(e0)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(d == 0, 0.0, d / allowed)
    norm_a, norm_e, norm_d = np.linalg.norm(a0), np.linalg.norm(e0), np.linalg.norm(a0 - e0)
    if norm_a == 0 and norm_e == 0:
        cosine = 1.0
    elif norm_a == 0 or norm_e == 0:
        cosine = 0.0
    else:
        cosine = float(np.real(np.vdot(e0, a0))) / (norm_a * norm_e)
    rel = d / (np.abs(e0) + 1e-10)
    return {
        "max_abs": d.max(),
        "abs_index": np.unravel_index(int(d.argmax()), shape) if d.max() > 0 else None,
        "max_rel": rel.max(),
        "rel_index": np.unravel_index(int(rel.argmax()), shape) if d.max() > 0 else None,
        "rel_l2": norm_d / norm_e if norm_e > 0 else (0.0 if norm_d == 0 else INF),
        "cosine": cosine,
        "mismatched": int((d > allowed).sum() + bad_special.sum()),
        "nonfinite_mismatched": int(bad_special.sum()),
        "nonfinite_index": np.unravel_index(int(bad_special.argmax()), shape) if bad_special.any() else None,
        "err_ratio": INF if bad_special.any() else ratio.max(),
    }


def assert_matches_numpy(leaf: LeafResult, actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance) -> dict:
    ref = reference_metrics(actual, expected, tol.rtol, tol.atol)
    as_tuple = lambda i: None if i is None else tuple(int(x) for x in i)  # noqa: E731
    assert leaf.problem is None
    assert leaf.numel == expected.numel()
    assert leaf.mismatched == ref["mismatched"]
    assert leaf.nonfinite_mismatched == ref["nonfinite_mismatched"]
    assert leaf.nonfinite_index == as_tuple(ref["nonfinite_index"])
    assert leaf.abs_index == as_tuple(ref["abs_index"])
    assert leaf.rel_index == as_tuple(ref["rel_index"])
    if expected.is_complex():  # |z| by hypot in both, but not necessarily the same last bit
        assert leaf.max_abs == pytest.approx(ref["max_abs"], rel=1e-15, abs=0)
        assert leaf.max_rel == pytest.approx(ref["max_rel"], rel=1e-15, abs=0)
        assert leaf.err_ratio == pytest.approx(ref["err_ratio"], rel=1e-15, abs=0)
    else:  # the same float64 operations in the same order: bit-identical
        assert leaf.max_abs == ref["max_abs"]
        assert leaf.max_rel == ref["max_rel"]
        assert leaf.err_ratio == ref["err_ratio"]
    assert leaf.rel_l2 == pytest.approx(ref["rel_l2"], rel=1e-12, abs=0)
    assert leaf.cosine == pytest.approx(ref["cosine"], rel=0, abs=1e-12)
    assert leaf.passed == (ref["mismatched"] <= tol.allowed_mismatches(expected.numel()))
    return ref


# --------------------------------------------------------------------------------------------
# metrics on known arrays


def _pair(seed: int, shape, scale: float = 1e-5, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(shape, generator=g, dtype=torch.float64)
    a = e + scale * torch.randn(shape, generator=g, dtype=torch.float64)
    return a.to(dtype), e.to(dtype)


KNOWN = {
    "small-diffs": _pair(0, (4, 5)),
    "one-outlier": (torch.tensor([[1.0, -2.0, 3.0], [4.0, 5.5, -6.0]]), torch.tensor([[1.0, -2.0, 3.0], [4.0, 5.0, -6.0]])),
    "negative": (torch.tensor([-1.0, -2.5, -1e-3, -7.0]), torch.tensor([-1.0, -2.0, -2e-3, -7.0])),
    "sign-flip": (torch.tensor([1.0, -2.0, 3.0]), torch.tensor([-1.0, 2.0, -3.0])),
    "zeros-both": (torch.zeros(3, 2), torch.zeros(3, 2)),
    "zeros-expected": (torch.tensor([0.0, 1e-3, -2.0]), torch.zeros(3)),
    "zeros-actual": (torch.zeros(3), torch.tensor([0.0, 1e-3, -2.0])),
    "zeros-some": (torch.tensor([0.0, 0.0, 1.0, 1e-6]), torch.tensor([0.0, 1e-7, 1.0, 0.0])),
    "tiny": (torch.tensor([1e-30, 2e-30]), torch.tensor([1.5e-30, 2e-30])),
    "large": (torch.tensor([3e38, -3e38]), torch.tensor([-3e38, 3e38])),  # |a − e| > fp32 max
    "0-d": (torch.tensor(2.5), torch.tensor(2.0)),
    "0-d-equal-sign": (torch.tensor(-0.0), torch.tensor(0.0)),
    "float64": _pair(1, (3, 3), 1e-9, torch.float64),
    "bf16": _pair(2, (6, 7), 1e-2, torch.bfloat16),
    "fp16": _pair(3, (6, 7), 1e-3, torch.float16),
    "int64": (torch.tensor([1, -5, 7, 0]), torch.tensor([1, -4, 7, 3])),
    "bool": (torch.tensor([True, False, True]), torch.tensor([True, True, True])),
    "complex64": (torch.tensor([1 + 1j, 2 - 1j, -3j]), torch.tensor([1 + 1j, 2 - 1.001j, 3j])),
}


@pytest.mark.parametrize("tol", [FP32, LOW_PRECISION, Tolerance(rtol=0.0, atol=1e-3), Tolerance(rtol=1e-2, atol=0.0), EXACT],
                         ids=["fp32", "bf16", "atol-only", "rtol-only", "exact"])
@pytest.mark.parametrize("case", list(KNOWN))
def test_metrics_match_numpy(case, tol):
    actual, expected = KNOWN[case]
    leaf = compare_tensors(actual, expected, tol, path=case)
    assert_matches_numpy(leaf, actual, expected, tol)
    assert leaf.shape == tuple(actual.shape) and leaf.dtype == str(actual.dtype).removeprefix("torch.")


def test_zero_conventions():
    both = compare_tensors(torch.zeros(4), torch.zeros(4), FP32)
    assert (both.rel_l2, both.cosine, both.max_rel, both.passed) == (0.0, 1.0, 0.0, True)
    only_expected = compare_tensors(torch.tensor([0.0, 1e-3]), torch.zeros(2), FP32)
    assert only_expected.rel_l2 == INF and only_expected.cosine == 0.0
    assert only_expected.max_rel == float(np.float32(1e-3)) / REL_EPS  # msprobe's eps guard
    only_actual = compare_tensors(torch.zeros(2), torch.tensor([0.0, 1e-3]), FP32)
    assert only_actual.rel_l2 == 1.0 and only_actual.cosine == 0.0


def test_opposite_vectors_have_cosine_minus_one_and_rel_l2_two():
    e = torch.tensor([1.0, -2.0, 3.0])
    leaf = compare_tensors(-e, e, FP32)
    assert leaf.cosine == pytest.approx(-1.0, abs=1e-15)
    assert leaf.rel_l2 == pytest.approx(2.0, rel=1e-15)


def test_cosine_keeps_its_digits_when_nearly_equal():
    # 1 - cosine ~ 5e-11 here; the identity-based formula agrees with an exact computation
    # (fp32 products are exact in float64, math.fsum rounds each sum once) to 1e-5 relative.
    a, e = _pair(4, (50_000,))
    A, E = _np(a), _np(e)
    exact = 1 - math.fsum(A * E) / math.sqrt(math.fsum(A * A) * math.fsum(E * E))
    leaf = compare_tensors(a, e, FP32)
    assert 1 - leaf.cosine == pytest.approx(exact, rel=1e-5)


def test_empty_tensors_pass_with_zero_metrics():
    leaf = compare_tensors(torch.empty(0, 3), torch.empty(0, 3), FP32)
    assert leaf.passed and leaf.numel == 0 and leaf.mismatched == 0
    assert (leaf.max_abs, leaf.max_rel, leaf.rel_l2, leaf.cosine, leaf.err_ratio) == (0.0, 0.0, 0.0, 1.0, 0.0)
    assert leaf.mismatched_frac == 0.0


def test_non_contiguous_inputs_are_indexed_logically():
    base_a, base_e = _pair(5, (6, 8))
    base_a[4, 2] += 0.5  # → after the transpose at index (2, 4)
    a, e = base_a.t()[:, ::2], base_e.t()[:, ::2]  # shape (8, 3), strided
    assert not a.is_contiguous()
    leaf = compare_tensors(a, e, FP32)
    assert_matches_numpy(leaf, a, e, FP32)
    assert leaf.abs_index == (2, 2)
    assert leaf.actual_at_abs == float(a[2, 2]) and leaf.expected_at_abs == float(e[2, 2])


def test_conjugated_complex_view_is_resolved():
    z = torch.tensor([1 + 2j, 3 - 1j])
    leaf = compare_tensors(z.conj(), z.conj().resolve_conj().clone(), FP32)
    assert leaf.passed and leaf.max_abs == 0.0
    moved = compare_tensors(z.conj(), z.clone(), FP32)  # conj(1+2j) - (1+2j) = -4j
    assert moved.max_abs == 4.0 and moved.abs_index == (0,)


def test_tensors_that_require_grad_are_compared():
    a = torch.tensor([1.0, 2.0], requires_grad=True)
    leaf = compare_tensors(a * 1, torch.tensor([1.0, 2.5]), FP32)
    assert leaf.abs_index == (1,) and leaf.max_abs == 0.5


def test_bf16_values_enter_exactly():
    # 1 + 2**-7 is a bf16 value; float64 arithmetic on it must see exactly 2**-7.
    leaf = compare_tensors(torch.tensor([1 + 2**-7], dtype=torch.bfloat16), torch.tensor([1.0], dtype=torch.bfloat16),
                           LOW_PRECISION)
    assert leaf.max_abs == 2**-7 and leaf.mismatched == 1


def test_first_index_wins_on_ties():
    e = torch.zeros(10)
    a = e.clone()
    a[3] = a[7] = 1.0
    leaf = compare_tensors(a, e, FP32)
    assert leaf.abs_index == (3,) and leaf.rel_index == (3,)


@pytest.mark.parametrize("block,threads", [(7, 1), (7, 3), (64, 2), (1, 4)])
def test_blocks_and_threads_give_the_same_metrics(monkeypatch, block, threads):
    # Small blocks and forced threads exercise the block-merge logic on a small tensor.
    monkeypatch.setattr(compare_mod, "BLOCK", block)
    monkeypatch.setattr(compare_mod, "WORKER_BLOCK", block)
    monkeypatch.setattr(compare_mod, "PARALLEL_MIN_BLOCKS", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    a, e = _pair(6, (13, 17))
    e[9, 3] = e[11, 0] = 1.0
    a[9, 3] = a[11, 0] = 1.25  # the worst absolute difference, tied: the earlier one is reported
    a[2, 5] = NAN     # a NaN mismatch in an early block
    e[5, 5] = INF     # and an Inf mismatch after it
    a[12, 16] = e[12, 16] = NAN  # NaN parity in the last element
    tol = Tolerance(rtol=1e-5, atol=1e-5, budget=0.05)
    leaf = compare_tensors(a, e, tol)
    ref = assert_matches_numpy(leaf, a, e, tol)
    assert leaf.abs_index == (9, 3) and leaf.nonfinite_index == (2, 5) and leaf.nonfinite_mismatched == 2
    assert ref["nonfinite_index"] == (2, 5)


def test_large_tensor_runs_on_threads_and_matches_numpy(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    n = compare_mod.BLOCK * compare_mod.PARALLEL_MIN_BLOCKS * 2 + 123
    a, e = _pair(7, (n,))
    a[n - 5] += 1.0
    calls = []
    real = compare_mod.ThreadPoolExecutor
    monkeypatch.setattr(compare_mod, "ThreadPoolExecutor", lambda *args, **kw: calls.append(kw) or real(*args, **kw))
    leaf = compare_tensors(a, e, FP32)
    assert calls and calls[0]["max_workers"] == 2
    assert_matches_numpy(leaf, a, e, FP32)
    assert leaf.abs_index == (n - 5,)


@pytest.mark.parametrize("pinned", [True, False])
def test_worker_threads_pin_only_their_own_intra_op_threads(monkeypatch, pinned):
    # Pinned workers (OpenMP backend) take WORKER_BLOCKs; unpinned ones keep BLOCKs. Same metrics.
    monkeypatch.setattr(compare_mod, "_per_thread_intra_op", lambda: pinned)
    monkeypatch.setattr(compare_mod, "BLOCK", 16)
    monkeypatch.setattr(compare_mod, "WORKER_BLOCK", 48)
    monkeypatch.setattr(compare_mod, "PARALLEL_MIN_BLOCKS", 2)
    before = torch.get_num_threads()
    sizes = []
    real = compare_mod._Accumulator
    monkeypatch.setattr(compare_mod, "_Accumulator", lambda tol, block, *dtypes: sizes.append(block) or real(tol, block, *dtypes))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    a, e = _pair(21, (1000,))
    leaf = compare_tensors(a, e, FP32)
    assert set(sizes) == {48 if pinned else 16} and len(sizes) == 2
    assert_matches_numpy(leaf, a, e, FP32)
    monkeypatch.undo()
    assert torch.get_num_threads() == before  # the caller's intra-op threads are untouched


def test_per_thread_probe_leaves_the_callers_thread_count(monkeypatch):
    monkeypatch.setattr(compare_mod, "_PER_THREAD", None)
    before = torch.get_num_threads()
    result = compare_mod._per_thread_intra_op()
    assert torch.get_num_threads() == before
    if before >= 2 and "parallel backend: OpenMP" in torch.__config__.parallel_info():
        assert result is True


def test_thread_count_is_capped(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 192)  # a large Ascend host
    monkeypatch.setattr(compare_mod, "BLOCK", 4)
    monkeypatch.setattr(compare_mod, "WORKER_BLOCK", 4)
    monkeypatch.setattr(compare_mod, "PARALLEL_MIN_BLOCKS", 1)
    calls = []
    real = compare_mod.ThreadPoolExecutor
    monkeypatch.setattr(compare_mod, "ThreadPoolExecutor", lambda *args, **kw: calls.append(kw) or real(*args, **kw))
    a, e = _pair(12, (1000,))
    leaf = compare_tensors(a, e, FP32)
    assert calls[0]["max_workers"] == compare_mod.MAX_THREADS
    assert_matches_numpy(leaf, a, e, FP32)


# --------------------------------------------------------------------------------------------
# NaN / Inf parity


@pytest.mark.parametrize("actual,expected,bad", [
    ([NAN, 1.0, NAN], [NAN, 1.0, NAN], 0),           # NaN in the same places: parity
    ([INF, -INF, 2.0], [INF, -INF, 2.0], 0),         # same-signed Inf: parity
    ([1.0, NAN, 2.0], [1.0, 2.0, NAN], 2),           # NaN moved
    ([INF, 1.0], [-INF, 1.0], 1),                    # Inf of the other sign
    ([INF, 1.0], [NAN, 1.0], 1),                     # Inf vs NaN
    ([5.0, 1.0], [INF, 1.0], 1),                     # finite vs Inf
    ([NAN, NAN], [NAN, 0.0], 1),
])
def test_nan_inf_parity(actual, expected, bad):
    a, e = torch.tensor(actual), torch.tensor(expected)
    leaf = compare_tensors(a, e, FP32)
    assert_matches_numpy(leaf, a, e, FP32)
    assert leaf.nonfinite_mismatched == bad
    assert leaf.passed == (bad == 0)
    assert (leaf.err_ratio == INF) == (bad > 0)


def test_nan_parity_metrics_cover_the_finite_positions_only():
    a = torch.tensor([NAN, 1.0, 2.5, INF])
    e = torch.tensor([NAN, 1.0, 2.0, INF])
    leaf = compare_tensors(a, e, FP32)
    assert leaf.max_abs == 0.5 and leaf.abs_index == (2,) and leaf.mismatched == 1
    assert leaf.rel_l2 == pytest.approx(0.5 / math.sqrt(5.0), rel=1e-15)


def test_nan_in_complex_tensors():
    a = torch.tensor([complex(NAN, 0), 1 + 1j])
    e = torch.tensor([complex(0, NAN), 1 + 1j])
    leaf = compare_tensors(a, e, FP32)  # NaN in either part counts as a NaN element, as in torch.isnan
    assert leaf.passed and leaf.nonfinite_mismatched == 0
    moved = compare_tensors(torch.tensor([complex(NAN, 0), 1 + 1j]), torch.tensor([1 + 0j, 1 + 1j]), FP32)
    assert moved.nonfinite_mismatched == 1 and moved.nonfinite_index == (0,)


def test_integers_near_the_int64_limits():
    # a − e would overflow int64; the float64 metrics and the exact verdict do not.
    leaf = compare_tensors(torch.tensor([2**62, -(2**62), 5]), torch.tensor([-(2**62), 2**62, 5]), EXACT)
    assert leaf.mismatched == 2 and leaf.max_abs == 2.0**63 and leaf.abs_index == (0,)
    assert leaf.cosine == pytest.approx(-1.0, abs=1e-12)


# --------------------------------------------------------------------------------------------
# verdicts on the boundary and the budget

# e = 1, rtol = atol = 2**-17: allowed = 2**-17 + 2**-17 * 1 = 2**-16 exactly, in fp32 and float64.
BOUNDARY = Tolerance(rtol=2.0**-17, atol=2.0**-17)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_element_exactly_at_the_allowed_error_passes(dtype):
    e = torch.tensor([1.0, 3.0], dtype=dtype)
    a = torch.tensor([1.0 + 2.0**-16, 3.0], dtype=dtype)
    leaf = compare_tensors(a, e, BOUNDARY)
    assert leaf.passed and leaf.mismatched == 0 and leaf.err_ratio == 1.0
    assert bool(torch.isclose(a, e, rtol=BOUNDARY.rtol, atol=BOUNDARY.atol).all())  # torch agrees


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_element_one_ulp_above_the_allowed_error_fails(dtype):
    ulp = 2.0**-23 if dtype == torch.float32 else 2.0**-52
    e = torch.tensor([1.0, 3.0], dtype=dtype)
    a = torch.tensor([1.0 + 2.0**-16 + ulp, 3.0], dtype=dtype)
    assert float(a[0]) == 1.0 + 2.0**-16 + ulp  # representable
    leaf = compare_tensors(a, e, BOUNDARY)
    assert not leaf.passed and leaf.mismatched == 1 and leaf.err_ratio > 1.0
    assert not bool(torch.isclose(a, e, rtol=BOUNDARY.rtol, atol=BOUNDARY.atol).all())


def test_negative_expected_uses_its_magnitude():
    e = torch.tensor([-1.0])
    assert compare_tensors(torch.tensor([-1.0 - 2.0**-16]), e, BOUNDARY).passed
    assert not compare_tensors(torch.tensor([-1.0 - 2.0**-16 - 2.0**-23]), e, BOUNDARY).passed


def test_exact_tolerance():
    e = torch.tensor([0.0, 1.0, -2.0])
    same = compare_tensors(e.clone(), e, EXACT)
    assert same.passed and same.err_ratio == 0.0
    nudged = e.clone()
    nudged[0] = 1e-45  # the smallest fp32 subnormal
    leaf = compare_tensors(nudged, e, EXACT)
    assert not leaf.passed and leaf.mismatched == 1 and leaf.err_ratio == INF and leaf.abs_index == (0,)


@pytest.mark.parametrize("k", [0, 1, 3])
def test_budget_allows_k_mismatches_and_fails_at_k_plus_1(k):
    tol = Tolerance(rtol=1e-5, atol=1e-5, budget=k / 1000)
    e = torch.linspace(-1, 1, 1000)
    for moved, verdict in ((k, True), (k + 1, False)):
        a = e.clone()
        a[:moved] += 1e-2
        leaf = compare_tensors(a, e, tol)
        assert leaf.allowed == k
        assert leaf.mismatched == moved
        assert leaf.passed is verdict


def test_the_built_in_budget_takes_elements_within_100x_the_bound_and_a_users_any_amount():
    e = torch.randn(2048, generator=torch.Generator().manual_seed(0)) * 1e-3
    for offset, verdict in ((0.05, True), (1000.0, False)):  # err/tol about 50 and 1e6
        a = e.clone()
        a[5] += offset
        leaf = compare_tensors(a, e, LOW_PRECISION)
        assert leaf.mismatched == 1 <= leaf.allowed
        assert leaf.passed is verdict
    # an rtol or atol of the user's keeps the built-in budget, and its bound (a written-out default too)...
    for override in ({"rtol": 2e-3}, {"atol": 5e-4}, {"rtol": 1e-3}, {"reason": "r"}):
        assert not compare_tensors(a, e, LOW_PRECISION.replace(source="ini", **override)).passed, override
    # ...while a budget of the user's is taken as written, as is a Tolerance built with one
    assert compare_tensors(a, e, LOW_PRECISION.replace(source="ini", budget=1e-3, reason="a known outlier")).passed
    assert compare_tensors(a, e, Tolerance(rtol=1e-3, atol=1e-3, budget=1e-3)).passed
    with pytest.raises(ParityError, match=r"each within 100x the bound: the worst is 9.99e\+05x outside it"):
        compare(a, e, LOW_PRECISION, name="spike").raise_if_failed()


@pytest.mark.parametrize("special", [NAN, INF, -INF])
@pytest.mark.parametrize("tolerance", [LOW_PRECISION, Tolerance(rtol=1e-3, atol=1e-3, budget=1e-2, source="marker")],
                         ids=["built-in budget", "a user's budget"])
def test_no_budget_takes_a_nan_or_inf_on_one_side_only(special, tolerance):
    e = torch.randn(4096, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    a = e.clone()
    a[7] = special  # one overflowed or uninitialized element: a fault, not rounding
    leaf = compare_tensors(a, e, tolerance)
    assert leaf.mismatched == 1 <= leaf.allowed and leaf.nonfinite_mismatched == 1
    assert not leaf.passed
    with pytest.raises(ParityError, match=r"takes no NaN or Inf where the other side has none"):
        compare(a, e, tolerance, name="overflow").raise_if_failed()
    a[7] = e[7] * (1 + 2e-3)  # the same element off by rounding: the budget takes it
    assert compare_tensors(a, e, tolerance).passed


def test_budget_rounds_down_but_survives_binary_rounding():
    assert Tolerance(rtol=0, atol=0, budget=0.29).allowed_mismatches(100) == 29  # 0.29*100 = 28.999…
    assert Tolerance(rtol=0, atol=0, budget=1e-3).allowed_mismatches(1999) == 1
    assert LOW_PRECISION.allowed_mismatches(999) == 0


def test_integer_leaves_are_exact_beyond_float64_precision():
    big = 2**60
    leaf = compare_tensors(torch.tensor([big + 1, 3]), torch.tensor([big, 3]), EXACT)
    assert float(big + 1) == float(big)  # float64 cannot tell them apart
    assert not leaf.passed and leaf.mismatched == 1 and leaf.abs_index == (0,) and leaf.max_abs == 1.0
    assert leaf.actual_at_abs == big + 1 and leaf.expected_at_abs == big
    result = compare(torch.tensor([big + 1]), torch.tensor([big]), FP32, name="ids")
    assert str(big + 1) in result.format()  # integers are printed in full


def test_compare_judges_integers_exactly_whatever_the_policy():
    loose = Tolerance(rtol=0.5, atol=10.0)
    result = compare({"ids": torch.tensor([1, 2]), "x": torch.tensor([1.0, 2.0])},
                     {"ids": torch.tensor([1, 3]), "x": torch.tensor([1.0, 3.0])}, loose)
    by_path = {leaf.path: leaf for leaf in result.leaves}
    assert not by_path["ids"].passed and by_path["ids"].tolerance == EXACT
    assert by_path["x"].passed and by_path["x"].tolerance == loose


# --------------------------------------------------------------------------------------------
# structures


def test_flatten_paths():
    x, y = torch.zeros(1), torch.ones(1)
    paths = [p for p, _ in flatten({"a": (x, {"b": y}), "c": [x, None], "d": 1.5})]
    assert paths == ["a[0]", "a[1].b", "c[0]", "c[1]", "d"]
    assert [p for p, _ in flatten((x, [y]))] == ["[0]", "[1][0]"]
    assert [p for p, _ in flatten(x)] == [""]


def test_python_numbers_become_exact_tensors():
    leaves = dict(flatten({"f": 0.1, "i": 2**62, "b": True, "c": 1 + 2j}))
    assert leaves["f"].dtype == torch.float64 and leaves["f"].item() == 0.1
    assert leaves["i"].dtype == torch.int64 and leaves["i"].item() == 2**62
    assert leaves["b"].dtype == torch.bool
    assert leaves["c"].dtype == torch.complex128
    leaf = compare({"loss": 0.1}, {"loss": 0.1 + 8e-17}).leaves[0]  # 8e-17 is lost in float32
    assert leaf.max_abs == abs(0.1 - (0.1 + 8e-17)) > 0 and leaf.tolerance == FP64 and leaf.passed
    assert not compare({"loss": 0.1}, {"loss": 0.1 + 8e-17}, EXACT).passed
    with pytest.raises(ValueError, match="cannot compare the number 1180591620717411303424 at 'big'"):
        compare({"big": 2**70}, {"big": 2**70})


def test_unsupported_leaf_names_its_path():
    with pytest.raises(TypeError, match=r"cannot compare a frozenset at 'meta\.name'"):
        compare({"meta": {"name": frozenset("x")}}, {"meta": {"name": frozenset("x")}})
    with pytest.raises(TypeError, match="at the top level"):
        compare(object(), object())


def test_duplicate_paths_are_an_error():
    with pytest.raises(ValueError, match=r"same path 'a\.b'"):
        compare({"a.b": torch.zeros(1), "a": {"b": torch.zeros(1)}}, {"a.b": torch.zeros(1)})


def test_nested_structure_pass_and_fail():
    g = torch.Generator().manual_seed(8)
    e = {"logits": torch.randn(2, 3, generator=g), "aux": (torch.randn(4, generator=g), [torch.arange(3), 2.0])}
    same = compare({"logits": e["logits"].clone(), "aux": (e["aux"][0].clone(), [torch.arange(3), 2.0])}, e, name="s")
    assert same.passed and [leaf.path for leaf in same.leaves] == ["logits", "aux[0]", "aux[1][0]", "aux[1][1]"]
    moved = {"logits": e["logits"].clone(), "aux": (e["aux"][0].clone(), [torch.arange(3), 2.0])}
    moved["aux"][0][2] += 1.0
    result = compare(moved, e, name="s")
    assert [leaf.path for leaf in result.failures] == ["aux[0]"]
    assert result.failures[0].abs_index == (2,)


def test_missing_extra_and_none_leaves():
    t = torch.zeros(2)
    result = compare({"a": t, "c": None, "d": t}, {"a": t, "b": t, "c": t, "d": None}, FP32)
    problems = {leaf.path: leaf.problem for leaf in result.leaves}
    assert problems == {
        "a": None,
        "b": "missing in actual output",
        "c": "actual is None, the other is a tensor",
        "d": "expected is None, the other is a tensor",
    }
    assert not result.passed and len(result.failures) == 3
    extra = compare({"a": t, "z": t}, {"a": t}, FP32)
    assert [(leaf.path, leaf.problem) for leaf in extra.failures] == [("z", "not in expected output")]
    both_none = compare({"a": None}, {"a": None}, FP32)
    assert both_none.passed


def test_list_vs_tuple_and_length_mismatch():
    t = torch.ones(1)
    assert compare([t, t], (t, t)).passed  # same leaves by path
    shorter = compare([t], [t, t])
    assert [(leaf.path, leaf.problem) for leaf in shorter.failures] == [("[1]", "missing in actual output")]


def test_shape_and_dtype_mismatch_are_their_own_failures():
    shape = compare_tensors(torch.zeros(2, 3), torch.zeros(3, 2), FP32, "h")
    assert not shape.passed and shape.problem == "shape mismatch: actual (2, 3) vs expected (3, 2)"
    assert math.isnan(shape.max_abs)
    dtype = compare_tensors(torch.zeros(2), torch.zeros(2, dtype=torch.float64), FP32, "h")
    assert not dtype.passed and dtype.problem == "dtype mismatch: actual float32 vs expected float64"
    result = compare({"h": torch.zeros(2, 3)}, {"h": torch.zeros(3, 2)}, name="shapes")
    text = result.format()
    assert "output 'h': shape mismatch: actual (2, 3) vs expected (3, 2)" in text


def test_model_output_with_none_field():
    outputs = pytest.importorskip("transformers.modeling_outputs")
    h = torch.randn(1, 2, 3, generator=torch.Generator().manual_seed(9))
    expected = outputs.BaseModelOutput(last_hidden_state=h, hidden_states=None, attentions=(h * 2,))
    actual = outputs.BaseModelOutput(last_hidden_state=h.clone(), hidden_states=None, attentions=(h * 2,))
    result = compare(actual, expected, FP32, name="bert")
    assert result.passed
    assert [leaf.path for leaf in result.leaves] == ["last_hidden_state", "attentions[0]"]
    moved = outputs.BaseModelOutput(last_hidden_state=h.clone(), attentions=(h * 2 + 1,))
    failed = compare(moved, expected, FP32, name="bert")
    assert [leaf.path for leaf in failed.failures] == ["attentions[0]"]
    assert "attentions[0]" in failed.format()
    # a ModelOutput field present on one side only is a structural failure
    extra = compare(outputs.BaseModelOutput(last_hidden_state=h, hidden_states=(h,)), expected, FP32)
    assert ("hidden_states[0]", "not in expected output") in [(leaf.path, leaf.problem) for leaf in extra.failures]


def _kv(seed: int, layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, 2, 3, 4, generator=g), torch.randn(1, 2, 3, 4, generator=g)) for _ in range(layers)]


def _dynamic_cache(kv):
    cache_utils = pytest.importorskip("transformers.cache_utils")
    cache = cache_utils.DynamicCache()
    for i, (k, v) in enumerate(kv):
        cache.update(k.clone(), v.clone(), i)
    return cache


def test_a_dynamic_cache_in_a_model_output_flattens_into_named_layers():
    outputs = pytest.importorskip("transformers.modeling_outputs")
    kv = _kv(3)
    logits = torch.randn(1, 3, 5, generator=torch.Generator().manual_seed(4))
    expected = outputs.CausalLMOutputWithPast(logits=logits, past_key_values=_dynamic_cache(kv))
    actual = outputs.CausalLMOutputWithPast(logits=logits.clone(), past_key_values=_dynamic_cache(kv))
    result = compare(actual, expected, FP32, name="gpt2")
    assert result.passed
    assert [leaf.path for leaf in result.leaves] == [
        "logits", "past_key_values.layers[0].keys", "past_key_values.layers[0].values",
        "past_key_values.layers[1].keys", "past_key_values.layers[1].values"]
    # a wrong value in one layer's cache is found and named
    broken = [(k, v) for k, v in kv]
    broken[1] = (kv[1][0], kv[1][1] * (1 + 1e-3))
    bad = compare(outputs.CausalLMOutputWithPast(logits=logits, past_key_values=_dynamic_cache(broken)), expected, FP32)
    assert [leaf.path for leaf in bad.failures] == ["past_key_values.layers[1].values"]
    # a missing layer is a structural failure
    short = compare(outputs.CausalLMOutputWithPast(logits=logits, past_key_values=_dynamic_cache(kv[:1])), expected, FP32)
    assert ("past_key_values.layers[1].keys", "missing in actual output") in [(f.path, f.problem) for f in short.failures]


def test_encoder_decoder_static_and_legacy_caches_flatten():
    cache_utils = pytest.importorskip("transformers.cache_utils")
    kv = _kv(5, layers=1)
    both = cache_utils.EncoderDecoderCache(_dynamic_cache(kv), _dynamic_cache(_kv(6, layers=1)))
    assert [p for p, _ in flatten({"past_key_values": both})] == [
        "past_key_values.self_attention_cache.layers[0].keys", "past_key_values.self_attention_cache.layers[0].values",
        "past_key_values.cross_attention_cache.layers[0].keys", "past_key_values.cross_attention_cache.layers[0].values"]

    class Cache:  # the layout of transformers < 4.56 (key_cache / value_cache lists), recognized by name
        def __init__(self, kv):
            self.key_cache = [k for k, _ in kv]
            self.value_cache = [v for _, v in kv]

    class DynamicCache(Cache):
        pass

    leaves = dict(flatten(DynamicCache(kv)))
    assert list(leaves) == ["key_cache[0]", "value_cache[0]"] and leaves["key_cache[0]"] is kv[0][0]

    class Layer:
        def __init__(self):
            self.keys, self.values, self.is_initialized = None, None, False

    class EmptyCache(Cache):
        def __init__(self):
            self.layers = [Layer()]

    assert dict(flatten(EmptyCache())) == {"layers[0].keys": None, "layers[0].values": None}

    class OddCache(Cache):
        def __init__(self):
            pass

    with pytest.raises(TypeError, match="cannot compare a OddCache: a cache without layers"):
        list(flatten(OddCache()))


def test_generate_outputs_flatten_sequences_scores_and_cache():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32,
                                                                 n_positions=16)).eval()
    ids = torch.randint(0, 32, (2, 4))
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False,
                         pad_token_id=0, return_dict_in_generate=True, output_scores=True)
    assert type(out).__name__ == "GenerateDecoderOnlyOutput"
    leaves = dict(flatten(out))
    assert list(leaves) == ["sequences", "scores[0]", "scores[1]", "past_key_values.layers[0].keys",
                            "past_key_values.layers[0].values"]
    assert leaves["sequences"].dtype == torch.int64 and leaves["past_key_values.layers[0].keys"].shape[-2] == 5
    assert compare(out, out, name="generate").passed


def test_default_policy_follows_each_expected_dtype():
    result = compare({"f32": torch.ones(2), "bf16": torch.ones(2, dtype=torch.bfloat16), "i": torch.ones(2, dtype=torch.int32)},
                     {"f32": torch.ones(2), "bf16": torch.ones(2, dtype=torch.bfloat16), "i": torch.ones(2, dtype=torch.int32)})
    assert [leaf.tolerance for leaf in result.leaves] == [FP32, LOW_PRECISION, EXACT]


# --------------------------------------------------------------------------------------------
# the failure message


def _one_moved(shape=(3, 4), at=(1, 2), by=2e-3):
    e = torch.arange(12, dtype=torch.float32).reshape(shape) / 7 - 0.5
    a = e.clone()
    a[at] += by
    return a, e


def test_message_header_and_table():
    a, e = _one_moved()
    result = compare({"out": a, "ok": e.clone()}, {"out": e, "ok": e}, FP32, name="layer")
    text = result.format("recipe fp32, target cpu vs a live CPU run")
    lines = text.splitlines()
    assert lines[0] == "Parity check 'layer' failed (recipe fp32, target cpu vs a live CPU run)"
    assert lines[1] == "output 'out': Mismatched elements: 1 / 12 (8.3%) (up to 0 allowed by budget 0)"
    leaf = result.failures[0]
    assert lines[2] == (f"Greatest absolute difference: {leaf.max_abs:.6g} at index (1, 2) (up to 1e-05 allowed; "
                        f"actual {float(a[1, 2]):.9g}, expected {float(e[1, 2]):.9g})")
    assert lines[3] == f"Greatest relative difference: {leaf.max_rel:.6g} at index (1, 2) (up to 1e-05 allowed)"
    assert lines[4] == ""
    header, row = lines[5], lines[6]
    assert header.split() == ["leaf", "shape", "dtype", "max_abs", "max_rel", "rel_l2", "cosine", "mismatched",
                              "err/tol", "tolerance"]
    assert row.split()[:3] == ["out", "3x4", "float32"] and "1/12" in row.split()
    assert len(lines) == 7  # the passing leaf 'ok' is not in the failure table


def test_message_names_the_first_nonfinite_position():
    a, e = _one_moved(by=0.0)
    a[0, 3] = NAN
    a[2, 1] = NAN
    text = compare(a, e, FP32, name="nan").format()
    assert "NaN/Inf positions differ at 2 elements, first at index (0, 3) (actual nan, expected " in text
    assert "err/tol" in text and "inf" in text.splitlines()[-1]
    single = compare(torch.tensor([INF]), torch.tensor([1.0]), FP32, name="inf").format()
    assert "NaN/Inf positions differ at 1 element, first at index (0,) (actual inf, expected 1)" in single


def test_message_percent_is_never_zero_for_a_nonzero_share():
    e = torch.zeros(20_000)
    a = e.clone()
    a[123] = 1.0
    text = compare(a, e, FP32, name="big").format()
    assert "Mismatched elements: 1 / 20000 (0.005%)" in text


def test_message_header_is_the_worst_leaf_and_table_lists_every_failure():
    a1, e1 = _one_moved(by=1e-3)
    a2, e2 = _one_moved(at=(0, 0), by=1e-1)
    result = compare({"mild": a1, "worst": a2}, {"mild": e1, "worst": e2}, FP32, name="two")
    lines = result.format().splitlines()
    assert lines[1].startswith("output 'worst': Mismatched elements")
    table_leaves = [line.split()[0] for line in lines[lines.index("") + 2:]]
    assert table_leaves == ["mild", "worst"]


def test_passed_result_formats_all_leaves_and_raises_nothing():
    result = compare({"x": torch.ones(2)}, {"x": torch.ones(2)}, FP32, name="fine")
    assert result and result.format().splitlines()[0] == "Parity check 'fine' passed"
    result.raise_if_failed()


def test_raise_if_failed_carries_the_result():
    a, e = _one_moved()
    result = compare(a, e, FP32, name="boom")
    with pytest.raises(ParityError) as info:
        result.raise_if_failed("ctx")
    assert info.value.result is result
    assert isinstance(info.value, AssertionError)
    assert "Parity check 'boom' failed (ctx)" in str(info.value)


def test_to_row_is_flat_and_names_the_verdict():
    a, e = _one_moved()
    row = compare({"out": a}, {"out": e}, FP32).leaves[0].to_row()
    assert row["leaf"] == "out" and row["shape"] == "3x4" and row["verdict"] == "fail"
    assert row["mismatched"] == 1 and row["mismatched_frac"] == pytest.approx(1 / 12)
    assert all(isinstance(v, (str, int, float, type(None))) for v in row.values())


# --------------------------------------------------------------------------------------------
# the "done when"


def test_done_when_self_comparison_passes():
    t = torch.randn(5, 7, generator=torch.Generator().manual_seed(10))
    result = compare(t, t, FP32, name="self")
    assert result.passed and result.leaves[0].max_abs == 0.0 and result.leaves[0].cosine == 1.0


def test_done_when_one_element_moved_by_twice_the_tolerance_fails_and_is_named():
    e = torch.randn(5, 7, generator=torch.Generator().manual_seed(11))
    a = e.clone()
    allowed = FP32.atol + FP32.rtol * abs(float(e[3, 4]))
    a[3, 4] = float(e[3, 4]) + 2 * allowed
    result = compare({"y": a}, {"y": e}, FP32, name="moved")
    assert not result.passed
    leaf = result.leaves[0]
    assert leaf.mismatched == 1 and leaf.abs_index == (3, 4) and leaf.err_ratio == pytest.approx(2.0, rel=1e-2)
    assert re.search(r"Greatest absolute difference: \S+ at index \(3, 4\)", result.format())


def test_done_when_nan_in_different_positions_fails():
    e = torch.ones(4)
    a = torch.ones(4)
    e[1] = NAN
    a[2] = NAN
    result = compare(a, e, FP32, name="nan")
    assert not result.passed and result.leaves[0].nonfinite_mismatched == 2
    assert "first at index (1,)" in result.format()


def test_compare_result_is_a_plain_object():
    assert CompareResult(name="empty").passed  # no leaves, nothing failed


def test_named_tuple_and_dataclass_outputs_compare_by_field_name():
    import collections
    import dataclasses as dc

    Pair = collections.namedtuple("Pair", "mean scale")

    @dc.dataclass
    class Forecast:
        mean: torch.Tensor
        quantiles: tuple
        horizon: int
        label: str

    x, y = torch.ones(3), torch.zeros(2)
    forecast = Forecast(x, Pair(x, y), 7, "co2")
    assert [p for p, _ in flatten(forecast)] == ["mean", "quantiles.mean", "quantiles.scale", "horizon", "label"]
    assert compare(forecast, Forecast(x.clone(), Pair(x.clone(), y.clone()), 7, "co2")).passed
    moved = compare(forecast, Forecast(x, Pair(x, y + 1e-3), 7, "co2"))
    assert not moved.passed and [leaf.path for leaf in moved.leaves if not leaf.passed] == ["quantiles.scale"]
    # torch.return_types have no field names: positional as before
    assert [p for p, _ in flatten(torch.max(torch.eye(2), 1))] == ["[0]", "[1]"]


def test_string_and_integer_fields_are_compared_exactly_and_named():
    assert compare({"name": "co2", "n": 3}, {"name": "co2", "n": 3}).passed
    other = compare({"name": "co2", "n": 3}, {"name": "co3", "n": 3})
    assert not other.passed and [leaf.path for leaf in other.leaves if not leaf.passed] == ["name"]
    longer = compare({"name": "co2x"}, {"name": "co2"})
    assert not longer.passed and longer.leaves[0].path == "name"
    assert not compare({"n": 3}, {"n": 4}).passed
