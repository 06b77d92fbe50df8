"""Agreement of the ``golden msprobe`` limit set with msprobe 26.2.0's benchmark standard: per-side
metrics and the verdict on golden triples (target, reference, golden), computed by msprobe's own
``Comparator._compare_torch_tensor`` / ``BenchmarkPrecisionCompare`` (``msprobe_ref``). The tests
skip only when msprobe is not installed."""
from __future__ import annotations

import math

import pytest
import torch

from pytest_npu_parity.golden import MSPROBE_GOLDEN, METRICS, judge_golden_tensors, parse_policy_spec

from msprobe_ref import benchmark_metrics, benchmark_verdict, require_msprobe

NAN, INF = math.nan, math.inf
OURS_TO_MSPROBE = {"rmse": "rmse", "max_rel": "max_rel_error", "mean_rel": "mean_rel_error",
                   "small_share": "small_value_err_ratio", "balance": "eb"}


def _triple(dtype, n=2000, target_noise=1.0, seed=0, scale=1.0, golden_dtype=torch.float64):
    """A golden and two sides that round it to ``dtype``, the target with extra relative noise
    ``target_noise`` times one ulp of ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(n, generator=gen, dtype=torch.float64) * scale
    ulp = torch.finfo(dtype).eps
    e = (g * (1 + 0.5 * ulp * torch.randn(n, generator=gen, dtype=torch.float64))).to(dtype)
    a = (g * (1 + target_noise * ulp * torch.randn(n, generator=gen, dtype=torch.float64))).to(dtype)
    return a, e, g.to(golden_dtype)


def _set(t, at):
    t = t.clone()
    for i, v in at.items():
        t.view(-1)[i] = v
    return t


def _triples():
    out = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        name = str(dtype).removeprefix("torch.")
        for noise in (0.5, 1.0, 1.5, 3.0, 20.0):
            out[f"{name} target noise x{noise}"] = (*_triple(dtype, target_noise=noise, seed=int(noise * 10)), None)
        out[f"{name} near the small-value threshold"] = (
            *_triple(dtype, target_noise=4.0, seed=1, scale=2.0 ** (-10 if dtype != torch.float32 else -20)), None)
        out[f"{name} matmul, noise x1.5"] = (*_triple(dtype, target_noise=1.5, seed=2), "matmul")
        out[f"{name} layer_norm, noise x3"] = (*_triple(dtype, target_noise=3.0, seed=3), "layer_norm")
        out[f"{name} embedding, noise x3"] = (*_triple(dtype, target_noise=3.0, seed=4), "embedding")
        a, e, g = _triple(dtype, seed=5)
        out[f"{name} zeros in the golden"] = (_set(a, {0: 1e-3, 1: 0.0}), _set(e, {0: 0.0, 1: 0.0}),
                                             _set(g, {0: 0.0, 1: 0.0}), None)
        out[f"{name} NaN at the same place"] = (_set(a, {3: NAN}), _set(e, {3: NAN}), g, None)
        out[f"{name} golden Inf at the same place"] = (_set(a, {3: INF}), _set(e, {3: INF}), _set(g, {3: INF}), None)
    a, e, g = _triple(torch.float32, seed=6)
    out["fp32 golden (bf16 work)"] = (*_triple(torch.bfloat16, seed=7, golden_dtype=torch.float32), None)
    out["0-d"] = (a[:1].reshape(()), e[:1].reshape(()), g[:1].reshape(()), None)
    out["1-element"] = (a[:1], e[:1], g[:1], None)
    out["2-d 40x50"] = (a.reshape(40, 50), e.reshape(40, 50), g.reshape(40, 50), "mm")
    out["target all zero"] = (torch.zeros(2000), e, g, None)
    out["everything zero"] = (torch.zeros(10), torch.zeros(10), torch.zeros(10, dtype=torch.float64), None)
    out["sum, large error"] = (*_triple(torch.float32, target_noise=1e4, seed=8), "sum")
    return out


TRIPLES = _triples()
ONE_SIDED = {
    "NaN on the target only": (lambda a, e, g: (_set(a, {5: NAN}), e, g)),
    "-Inf vs +Inf": (lambda a, e, g: (_set(a, {5: -INF}), _set(e, {5: INF}), _set(g, {5: INF}))),
    "Inf on the target only": (lambda a, e, g: (_set(a, {5: INF}), e, g)),
}


def _ours(a, e, g, op):
    policy = MSPROBE_GOLDEN.replace(op=op)
    return judge_golden_tensors(a, e, g, policy)


def _theirs(a, e, g, op):
    api = op or "add"  # an op of level L0
    npu, gpu = benchmark_metrics(g, a, api), benchmark_metrics(g, e, api)
    return npu, gpu, benchmark_verdict(npu, gpu, a.dtype, api)


@pytest.mark.parametrize("case", list(TRIPLES))
def test_verdict_equals_msprobe(case):
    require_msprobe()
    a, e, g, op = TRIPLES[case]
    leaf = _ours(a, e, g, op)
    _, _, verdict = _theirs(a, e, g, op)
    assert leaf.msprobe_verdict == verdict
    assert leaf.passed == (verdict == "pass")  # no one-sided NaN/Inf here: our rule adds nothing


@pytest.mark.parametrize("case", list(TRIPLES))
def test_side_metrics_equal_msprobe(case):
    require_msprobe()
    a, e, g, op = TRIPLES[case]
    leaf = _ours(a, e, g, op)
    npu, gpu, _ = _theirs(a, e, g, op)
    for ours, theirs in ((leaf.target, npu), (leaf.reference, gpu)):
        for metric, name in OURS_TO_MSPROBE.items():
            # float32 means (bf16 outputs) round in msprobe's NumPy: 1e-6 relative
            assert getattr(ours, metric) == pytest.approx(float(theirs[name]), rel=1e-6, abs=1e-300), (metric, case)


def test_verdicts_cover_pass_and_error_and_every_level():
    require_msprobe()
    verdicts = {_theirs(*TRIPLES[c][:3], TRIPLES[c][3])[2] for c in TRIPLES}
    assert verdicts == {"pass", "error"}
    # one triple whose verdict msprobe changes with the op level (L0 pass, L2 error): ours follows
    _, e, g, _ = TRIPLES["float32 target noise x1.5"]
    # relative error ~1e-4: ratios ~1.3-6.5 over msprobe's fp32 floor 2^-14
    a = (g * (1 + 1e-4 * torch.randn(g.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64))).float()
    verdicts = {op: _theirs(a, e, g, op)[2] for op in ("add", "embedding", "matmul")}
    assert verdicts["add"] == "pass" and verdicts["matmul"] == "error"
    assert {op: _ours(a, e, g, op).msprobe_verdict for op in verdicts} == verdicts


@pytest.mark.parametrize("case", list(ONE_SIDED))
def test_one_sided_nan_inf_is_our_stricter_rule(case):
    """msprobe's benchmark leaves NaN/Inf positions out of its metrics and passes; we fail."""
    require_msprobe()
    a, e, g = ONE_SIDED[case](*_triple(torch.float32, seed=9))
    leaf = _ours(a, e, g, None)
    verdict = _theirs(a, e, g, None)[2]
    assert leaf.msprobe_verdict == verdict == "pass"
    assert not leaf.passed and leaf.nonfinite_mismatched == 1


def test_limits_per_op_level():
    assert MSPROBE_GOLDEN.limits == {"rmse": 2.0, "max_rel": 10.0, "mean_rel": 2.0, "small_share": 2.0}
    assert MSPROBE_GOLDEN.replace(op="embedding").limits == {"rmse": 1.5, "max_rel": 5.0, "mean_rel": 1.5, "small_share": 2.0}
    for op in ("matmul", "mm", "addmm", "layer_norm", "GELU", "sum"):
        assert MSPROBE_GOLDEN.replace(op=op).limits == {"rmse": 1.2, "max_rel": 2.0, "mean_rel": 1.2, "small_share": 2.0}


def test_policy_spec_selects_msprobe():
    p = parse_policy_spec("golden msprobe op=matmul # as msprobe judges it", source="marker", recipe="bf16")
    assert p.msprobe and p.op == "matmul" and p.reason == "as msprobe judges it"
    assert p.describe().startswith("golden msprobe op=matmul (L2) rmse<=1.2 max_rel<=2")
    assert not parse_policy_spec("golden", source="marker", recipe="bf16").msprobe
    with pytest.raises(ValueError, match="expected only op=NAME"):
        parse_policy_spec("golden msprobe rmse=3", source="marker", recipe="fp32")
    with pytest.raises(ValueError, match="op="):
        parse_policy_spec("golden op=matmul", source="marker", recipe="fp32")


def test_floor_and_ratio_known_answers():
    """Known answers from msprobe 26.2.0's ``calc_ratio`` (floors 2^-8 / 2^-11 / 2^-14 by dtype)."""
    from pytest_npu_parity.golden import msprobe_ratio

    assert msprobe_ratio(1e-3, 0.0, torch.float32) == 1e-3 / 2 ** -14
    assert msprobe_ratio(1e-2, 1e-9, torch.bfloat16) == 1e-2 / 2 ** -8
    assert msprobe_ratio(-1e-2, 1e-9, torch.float16) == 1e-2 / 2 ** -11
    assert math.isnan(msprobe_ratio(INF, INF, torch.float32)) and msprobe_ratio(INF, 1.0, torch.float32) == INF


def test_empty_tensor_passes_and_msprobe_skips():
    leaf = _ours(torch.empty(0), torch.empty(0), torch.empty(0, dtype=torch.float64), None)
    assert leaf.passed and leaf.msprobe_verdict is None


def test_metrics_in_row():
    a, e, g, _ = TRIPLES["float32 target noise x1.0"]
    row = _ours(a, e, g, "matmul").to_row()
    assert row["golden_msprobe_verdict"] in ("pass", "error") and "msprobe op=matmul" in row["golden_policy"]
    assert set(METRICS) <= {k.removeprefix("golden_").removesuffix("_ratio") for k in row if k.endswith("_ratio")}
