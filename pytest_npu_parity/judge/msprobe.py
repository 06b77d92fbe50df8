"""What msprobe would say: msprobe's own numbers beside ours, reproduced from its source.

msprobe (PyPI ``mindstudio-probe``, Ascend's accuracy tool; 26.2.0 read) has conventions of its own
that differ from ours in documented places. This module holds them, so a report can be read next to
an msprobe CSV and a verdict can be taken by msprobe's rules, while our own judges stay readable:

* the dump compare (``msprobe -f pytorch compare``): ``MsprobeView``, the six columns of its CSV for
  one tensor pair, with ``msprobe_format``, ``msprobe_rel_dtype`` and the view's assembly from the
  blockwise sums (``_msprobe_view``) or of a one-element pair (``_msprobe_scalar``). The sums
  themselves are taken by the allclose judge's one blockwise pass (``judge.allclose._Accumulator``),
  so a tensor is read once for both.
* the benchmark standard (``msprobe/pytorch/api_accuracy_checker``; our ``golden msprobe`` limit
  set): the constants of ``standard_config.py::StandardConfig`` (``MSPROBE_SMALL_VALUE`` …, the op
  levels of ``msprobe_level``), one side's metrics against the golden (``_MsprobeSums``, which fills
  ``judge.golden_metrics.SideMetrics``) and msprobe's ratio (``msprobe_ratio``). The verdict is
  taken by the golden judge (``judge.golden``), whose module docstring gives the pipeline reproduced.

The engine does not import pytest.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .golden_metrics import SideMetrics


#: The one-thousandth and five-thousandths thresholds of msprobe's dump compare
#: (``core/common/const.py::CompareConst.THOUSAND_RATIO_THRESHOLD`` / ``FIVE_THOUSAND_RATIO_THRESHOLD``).
MSPROBE_THOUSANDTH = 0.001
MSPROBE_FIVE_THOUSANDTHS = 0.005
#: msprobe's "all zero" bound for the cosine: ``Const.FLOAT_EPSILON`` = ``np.finfo(float).eps``.
MSPROBE_ZERO_NORM = 2.0 ** -52
#: Cosines above this are rounded to 6 decimals (``CompareConst.COSINE_THRESHOLD``).
MSPROBE_COSINE_ROUND_ABOVE = 0.9999
#: msprobe's markers for a cell without a number (``CompareConst.UNSUPPORTED``, ``N_A``, ``NAN``).
MSPROBE_UNSUPPORTED, MSPROBE_NA, MSPROBE_NAN = "unsupported", "N/A", "Nan"
#: The view's columns, in msprobe's CSV order (Cosine, EucDist, MaxAbsErr, MaxRelativeErr,
#: One Thousandth Err Ratio, Five Thousandths Err Ratio).
MSPROBE_COLUMNS = ("cosine", "euc_dist", "max_abs_err", "max_rel_err", "one_thousandth", "five_thousandths")


def msprobe_format(value: float) -> float:
    """msprobe's ``core/common/utils.py::format_value``: ``float('{:.12f}'.format(value))`` (12 decimals,
    so 3e-14 becomes 0.0). Applied, as msprobe does, to every view column but ``euc_dist``."""
    return float("{:.12f}".format(value))


@dataclass
class MsprobeView:
    """What msprobe 26.2.0's dump compare writes for one tensor pair (NPU = our target ``a``, bench =
    our reference ``e``), reproduced from its source. A cell is a float, or msprobe's marker string
    (``"unsupported"``, ``"N/A"``, ``"Nan"``) where msprobe writes no number; ``reason`` says why.

    The pipeline reproduced (paths under ``msprobe/`` of mindstudio-probe 26.2.0):

    * reading: ``pytorch/compare/utils.py::read_pt_data`` — bf16 becomes float32, then ``np.squeeze``:
      a 1-element tensor is 0-d for msprobe, a ``1x1x5`` one is ``5``;
    * checks: ``core/compare/npy_compare.py::ValidateTensor.check_tensor`` — empty: every cell
      ``unsupported``; 0-d: ``cosine``, ``euc_dist`` and both ratios ``unsupported`` (and NaN/Inf are
      not looked at); Inf or NaN masks that differ anywhere: every cell ``N/A``; equal masks
      (also −Inf against +Inf): those positions are set to 0 on both sides before measuring;
    * ``cosine`` — ``algorithm/builtin_algorithm/alg_cosine_similarity.py::compare``: float64
      Σn·b / (‖n‖ ‖b‖); 1.0 when both norms are ≤ 2^-52, ``Nan`` when one is; ``format_value``, then
      rounded to 6 decimals when above 0.9999;
    * ``euc_dist`` — ``alg_euclidean_distance.py``: ‖n − b‖₂ in float64 (not formatted);
    * ``max_abs_err`` — ``alg_max_absolute_error.py``: max |n − b| in float64 (0-d: in the array's
      dtype, float16 for fp16); ``format_value``;
    * ``max_rel_err`` — ``alg_max_relative_error.py`` with ``core/compare/utils.py::get_relative_err``:
      max |(n − b) / b| computed in ``np.result_type(n, b, float32)`` (float32 for fp16/bf16/fp32,
      float64 for fp64 and integers), where b = 0 adding that type's eps to both n and b;
    * ``one_thousandth`` / ``five_thousandths`` — ``alg_one_thousand_error.py`` /
      ``alg_five_thousand_error.py`` with ``core/compare/utils.py::calc_relative_err_ratio``: share of
      elements whose relative error (as above) is < 0.001 / < 0.005 (compared in the same type).

    Not the dump compare: msprobe's acc_check (``pytorch/api_accuracy_checker``) divides by
    |b| + eps (eps 2^-8 for bf16, else ``finfo(bench).eps``) and normalizes its cosine by the max; the
    golden verdict's ``msprobe`` limit set reproduces that tool (see ``golden``).
    """

    cosine: float | str = MSPROBE_UNSUPPORTED
    euc_dist: float | str = MSPROBE_UNSUPPORTED
    max_abs_err: float | str = MSPROBE_UNSUPPORTED
    max_rel_err: float | str = MSPROBE_UNSUPPORTED
    one_thousandth: float | str = MSPROBE_UNSUPPORTED
    five_thousandths: float | str = MSPROBE_UNSUPPORTED
    reason: str | None = None

    @classmethod
    def all(cls, marker: str, reason: str) -> "MsprobeView":
        """Every cell ``marker`` (msprobe's ``error_value_process`` for a pair it cannot compare)."""
        return cls(*(marker,) * len(MSPROBE_COLUMNS), reason=reason)

    def as_dict(self) -> dict[str, float | str]:
        """``{column: cell}`` in ``MSPROBE_COLUMNS`` order."""
        return {c: getattr(self, c) for c in MSPROBE_COLUMNS}

    def to_row(self) -> dict[str, Any]:
        """``msprobe_<column>`` floats (None where msprobe writes a marker) and ``msprobe_note``
        (``"cosine=unsupported …: reason"``), for tables."""
        row: dict[str, Any] = {f"msprobe_{c}": (v if isinstance(v, float) else None) for c, v in self.as_dict().items()}
        markers = [f"{c}={v}" for c, v in self.as_dict().items() if not isinstance(v, float)]
        row["msprobe_note"] = (" ".join(markers) + (f": {self.reason}" if self.reason else "")) if markers else None
        return row


def msprobe_rel_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The type msprobe's dump compare computes relative errors in for tensors of ``dtype``:
    ``np.result_type(n, b, np.float32)`` after ``read_pt_data`` (bf16 read as float32, integers and
    bool cast to float64 by ``get_relative_err``): float32 for fp16/bf16/fp32, float64 for fp64,
    integers and bool. None for complex (msprobe's compare does not handle it)."""
    if dtype.is_complex:
        return None
    if dtype in (torch.float16, torch.bfloat16, torch.float32):
        return torch.float32
    return torch.float64


class _MsprobeSums(Protocol):
    """What ``_msprobe_view`` reads of the allclose judge's blockwise sums (``judge.allclose._Accumulator``
    has them), declared here so that this module does not import the judge that imports it."""

    ms_special_mismatched: int
    sum_aa: float
    sum_ee: float
    sum_ae: float
    sum_dd: float
    ms_max_rel: float
    max_abs: float
    ms_below: list[int]


def _msprobe_view(acc: _MsprobeSums, numel: int) -> MsprobeView:
    """``MsprobeView`` of a pair of more than one element from the blockwise sums (see its docstring)."""
    if acc.ms_special_mismatched:
        return MsprobeView.all(MSPROBE_NA, "the Inf/NaN positions of NPU and bench differ")
    norm_a, norm_e = math.sqrt(acc.sum_aa), math.sqrt(acc.sum_ee)
    if norm_a <= MSPROBE_ZERO_NORM and norm_e <= MSPROBE_ZERO_NORM:
        cosine: float | str = 1.0
    elif norm_a <= MSPROBE_ZERO_NORM or norm_e <= MSPROBE_ZERO_NORM:
        cosine = MSPROBE_NAN
    else:
        cos = acc.sum_ae / (norm_a * norm_e)
        if math.isnan(cos):
            cosine = MSPROBE_NAN
        else:
            cosine = msprobe_format(cos)
            if cosine > MSPROBE_COSINE_ROUND_ABOVE:
                cosine = round(cosine, 6)
    max_rel = MSPROBE_NAN if math.isnan(acc.ms_max_rel) else msprobe_format(acc.ms_max_rel)
    return MsprobeView(cosine=cosine, euc_dist=math.sqrt(acc.sum_dd), max_abs_err=msprobe_format(max(acc.max_abs, 0.0)),
                       max_rel_err=max_rel, one_thousandth=msprobe_format(acc.ms_below[0] / numel),
                       five_thousandths=msprobe_format(acc.ms_below[1] / numel))


def _msprobe_scalar(a: torch.Tensor, e: torch.Tensor) -> MsprobeView:
    """``MsprobeView`` of a 1-element pair, 0-d for msprobe after ``np.squeeze``: only the max errors,
    computed in the array's own dtype (float32 for bf16), NaN/Inf not zeroed (``check_tensor``
    returns before its NaN/Inf check for 0-d data)."""
    import numpy as np

    def numpy_of(t: torch.Tensor) -> "np.ndarray":
        t = t.reshape(())
        if t.dtype == torch.bfloat16:
            t = t.to(torch.float32)
        elif t.dtype == torch.bool:
            t = t.to(torch.float64)  # flatten_numpy: astype(float)
        return t.numpy()

    n, b = numpy_of(a), numpy_of(e)
    with np.errstate(all="ignore"):
        abs_err = float(np.abs(n - b))
        rel_type = np.result_type(n.astype(float) if n.dtype.kind not in "f" else n, np.float32)
        n_r, b_r = n.astype(rel_type), b.astype(rel_type)
        if b_r == 0:
            eps = np.finfo(rel_type).eps
            n_r, b_r = n_r + eps, b_r + eps
        rel = float(np.abs(np.divide(n_r - b_r, b_r)))
    reason = "0-d for msprobe (one element): cosine, EucDist and the ratios are not computed"
    return MsprobeView(max_abs_err=MSPROBE_NAN if math.isnan(abs_err) else msprobe_format(abs_err),
                       max_rel_err=MSPROBE_NAN if math.isnan(rel) else msprobe_format(rel), reason=reason)


# msprobe 26.2.0's benchmark standard (``golden msprobe``), from
# msprobe/pytorch/api_accuracy_checker/precision_standard/standard_config.py::StandardConfig.

#: ``_small_value``: |golden| at or below which an element is small, by the output's dtype.
MSPROBE_SMALL_VALUE: dict[torch.dtype, float] = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -10,
                                                 torch.float32: 2.0 ** -20}
#: ``_benchmark_small_value_atol``: absolute error above which a small element is wrong.
MSPROBE_SMALL_VALUE_ATOL: dict[torch.dtype, float] = {torch.float16: 1e-16, torch.bfloat16: 1e-16,
                                                      torch.float32: 2.0 ** -30}
#: ``_minmum_err``: the floor of the reference metric in every ratio (``algorithm.py::calc_ratio``).
MSPROBE_MIN_ERR: dict[torch.dtype, float] = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8,
                                             torch.float32: 2.0 ** -14}
#: ``CompareConst.BFLOAT16_EPS``: the eps of the relative error's denominator for bf16 outputs.
MSPROBE_BF16_EPS = 2.0 ** -8
#: ``get_benchmark_ratio_threshold``: (rmse, max_rel, mean_rel) ratio limits per op level.
MSPROBE_LEVEL_LIMITS: dict[str, tuple[float, float, float]] = {
    "L0": (2.0, 10.0, 2.0), "L1": (1.5, 5.0, 1.5), "L2": (1.2, 2.0, 1.2)}
#: ``_small_value_threshold['error_threshold']``: the small-value ratio limit, every level.
MSPROBE_SMALL_LIMIT = 2.0
#: ``L1_API_LIST`` and ``L2_API_LIST``: op names (msprobe's API names, case as there) of levels L1/L2.
MSPROBE_L1_OPS = frozenset({"embedding", "npu_fusion_attention_grad", "npu_fusion_attention", "scatter_",
                            "scatter_add_"})
MSPROBE_L2_OPS = frozenset({"addmm", "npu_cross_entropy_loss", "npu_cross_entropy_loss_backward", "GELU",
                            "layer_norm", "matmul", "mm", "index", "one_hot", "sum", "npu_rms_norm",
                            "npu_rms_norm_backward", "nonzero"})


def msprobe_level(op: str | None) -> str:
    """msprobe's level of an op name (``StandardConfig.get_api_level``): ``"L2"``, ``"L1"`` or ``"L0"``
    (also for None and names msprobe does not list)."""
    if op in MSPROBE_L2_OPS:
        return "L2"
    if op in MSPROBE_L1_OPS:
        return "L1"
    return "L0"


class _MsprobeSums:
    """Blockwise sums behind msprobe 26.2.0's benchmark metrics of one side (``golden msprobe``).

    ``dtype`` is the side's output dtype (what msprobe's ``BenchmarkCompare`` is given) and
    ``golden_dtype`` the golden's. Per element, as ``Comparator._compare_torch_tensor`` and
    ``BenchmarkCompare._pre_compare`` do it: for bf16 the output and the golden are float32 (the
    golden rounded), ``abs_err = |x − g|`` in the promoted type (float32 for bf16), finite where the
    output and the golden cast to the output's dtype are, small where ``|g| <= MSPROBE_SMALL_VALUE``,
    relative error ``abs_err / (|g| + eps)`` elsewhere (eps ``MSPROBE_BF16_EPS`` for bf16, else
    ``finfo(golden).eps``). Sums are float64 (msprobe's NumPy means run in the array's type, so an
    RMSE of a bf16 output can differ from msprobe's in its 7th digit).
    """

    def __init__(self, dtype: torch.dtype, golden_dtype: torch.dtype):
        self.dtype = dtype
        self.bf16 = dtype == torch.bfloat16
        self.side_dtype = torch.float32 if self.bf16 else dtype  # what msprobe's NumPy array holds
        self.golden_dtype = torch.float32 if self.bf16 else golden_dtype
        self.arith = torch.promote_types(self.side_dtype, self.golden_dtype)  # NumPy's x - g
        self.threshold = MSPROBE_SMALL_VALUE.get(dtype, MSPROBE_SMALL_VALUE[torch.float32])
        self.atol = MSPROBE_SMALL_VALUE_ATOL.get(dtype, MSPROBE_SMALL_VALUE_ATOL[torch.float32])
        self.eps = MSPROBE_BF16_EPS if self.bf16 else torch.finfo(self.golden_dtype).eps
        self.size = self.masked = self.normal = self.small = self.small_wrong = self.above = self.below = 0
        self.sum_sq = self.sum_rel = self.max_rel = 0.0

    def add(self, x64: torch.Tensor, g64: torch.Tensor) -> None:
        """Fold one block of the side ``x64`` and the golden ``g64`` (float64 holding the exact values)."""
        x, g = x64.to(self.side_dtype), g64.to(self.golden_dtype)
        g_side = _round_like_numpy(g64, self.side_dtype)  # NumPy's bench.astype(device.dtype)
        finite = torch.isfinite(x) & torch.isfinite(g_side)
        abs_err = (x.to(self.arith) - g.to(self.arith)).abs()
        abs_g = g.abs()
        small = (abs_g <= self.threshold) & finite
        normal = finite & ~small
        self.size += x.numel()
        self.masked += x.numel() - int(normal.sum())
        err_n = abs_err[normal]
        self.sum_sq += float(err_n.to(torch.float64).square().sum())
        k = int(normal.sum())
        if k:
            rel = err_n / (abs_g[normal] + self.eps)
            self.normal += k
            self.sum_rel += float(rel.to(torch.float64).sum())
            self.max_rel = max(self.max_rel, float(rel.max()))
        k = int(small.sum())
        if k:
            self.small += k
            self.small_wrong += int((abs_err[small] > self.atol).sum())
        # get_error_balance compares in the output's dtype
        self.above += int((x > g_side).sum())
        self.below += int((x < g_side).sum())

    def result(self) -> SideMetrics:
        out = SideMetrics(small=self.small, normal=self.normal)
        if self.size == 0:
            return out
        # algorithm.py::get_rmse: mean over all elements of the masked squares, times msprobe's correction
        mse = self.sum_sq / self.size * (self.size / (self.size - self.masked + 0.0001) + 0.0001)
        out.rmse = math.sqrt(mse)
        if self.normal:
            out.max_rel, out.mean_rel = self.max_rel, self.sum_rel / self.normal
        if self.small:
            out.small_share = self.small_wrong / self.small
        out.balance = abs(self.above - self.below) / self.size
        return out


def _round_like_numpy(x64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x64`` (float64) rounded once to ``dtype``, as NumPy's ``astype`` does. torch converts float64
    to float16 through float32 (two roundings, which differ from one at ties); rounding to float32
    *to odd* first makes the second rounding exact."""
    if dtype != torch.float16:
        return x64.to(dtype)
    f = x64.to(torch.float32)
    inexact = f.to(torch.float64) != x64
    if bool(inexact.any()):
        # round to odd: the float32 next to x64 towards zero, with its last mantissa bit set
        away = inexact & (f.to(torch.float64).abs() > x64.abs())
        f = torch.where(away, torch.nextafter(f, torch.zeros_like(f)), f)
        bits = f.view(torch.int32)
        f = torch.where(inexact & torch.isfinite(f), (bits | 1).view(torch.float32), f)
    return f.to(torch.float16)


def msprobe_ratio(target: float, reference: float, dtype: torch.dtype) -> float:
    """msprobe 26.2.0's ratio of one metric (``benchmark_compare.py::BenchmarkPrecisionCompare._calc_ratio``):
    ``|t| / max(|r|, MSPROBE_MIN_ERR[dtype])`` (``algorithm.py::calc_ratio``) for finite metrics; NaN
    (a pass) when both are NaN or both the same Inf; ``inf`` (an error) when only one is NaN/Inf or
    the Infs differ (``compare_utils.py::check_inf_or_nan``). ``dtype`` is the target's."""
    if not (math.isfinite(target) and math.isfinite(reference)):
        same = (math.isnan(target) and math.isnan(reference)) or (math.isinf(target) and target == reference)
        return math.nan if same else math.inf
    floor = MSPROBE_MIN_ERR.get(dtype, MSPROBE_MIN_ERR[torch.float32])
    return abs(target) / max(abs(reference), floor)
