"""What msprobe would say: msprobe's own numbers beside ours, reproduced from its source.

msprobe (PyPI ``mindstudio-probe``, Ascend's accuracy tool; 26.2.0 read) has conventions of its own
that differ from ours in documented places. This module holds them, so a report can be read next to
an msprobe CSV and a verdict can be taken by msprobe's rules, while our own judges stay readable:

* the dump compare (``msprobe -f pytorch compare``): ``MsprobeView``, the six columns of its CSV for
  one tensor pair, with ``msprobe_format``, ``msprobe_rel_dtype`` and the view's assembly from the
  blockwise sums (``_msprobe_view``) or of a one-element pair (``_msprobe_scalar``). The sums
  themselves are taken by the allclose judge's one blockwise pass (``judge.allclose._Accumulator``),
  so a tensor is read once for both.

The engine does not import pytest.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .allclose import _Accumulator


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


def _msprobe_view(acc: _Accumulator, numel: int) -> MsprobeView:
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
