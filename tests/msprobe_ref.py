"""msprobe 26.2.0 (PyPI ``mindstudio-probe``) called through its own functions, for the agreement
tests (``test_compare_msprobe.py``, ``test_golden_msprobe.py``). Nothing of msprobe is copied here:
every number comes from msprobe's code.

When msprobe is not installed the tests that need it skip (``require_msprobe``); when it is installed
but fails to import, they fail (a broken install must not pass silently).
"""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

MSPROBE_VERSION = "26.2.0"


def require_msprobe() -> None:
    """Skip the calling test when msprobe is absent; otherwise check its version."""
    if importlib.util.find_spec("msprobe") is None:
        pytest.skip("msprobe (pip install 'mindstudio-probe==26.2.0', the 'msprobe' extra) is not installed")
    from importlib.metadata import version

    assert version("mindstudio-probe") == MSPROBE_VERSION, "the agreement tests are written against msprobe 26.2.0"


def dump_compare(npu: torch.Tensor, bench: torch.Tensor) -> dict[str, object]:
    """The six columns msprobe's PyTorch dump compare writes for one pair, by msprobe's own code:
    ``pytorch/compare/utils.py`` (read: bf16 as float32, ``np.squeeze``), ``core/compare/npy_compare.py``
    (``ValidateTensor.check_tensor``, ``compare_ops_apply``). Keys are our ``MSPROBE_COLUMNS``."""
    from msprobe.core.common.const import CompareConst
    from msprobe.core.compare.npy_compare import CompareResult, ValidateTensor, compare_ops_apply
    from msprobe.pytorch.compare.utils import _prepare_tensor_for_numpy

    def read(t: torch.Tensor) -> np.ndarray:  # read_pt_data after load_pt
        return np.squeeze(_prepare_tensor_for_numpy(t.detach().cpu().clone()).numpy())

    checked = ValidateTensor().check_tensor(CompareResult(read(npu), read(bench)))
    columns = [CompareConst.COSINE, CompareConst.EUC_DIST, CompareConst.MAX_ABS_ERR, CompareConst.MAX_RELATIVE_ERR,
               CompareConst.ONE_THOUSANDTH_ERR_RATIO, CompareConst.FIVE_THOUSANDTHS_ERR_RATIO]
    values, _ = compare_ops_apply(checked.n_value, checked.b_value, checked.error_flag, checked.err_msg,
                                  column_names=columns)
    names = ("cosine", "euc_dist", "max_abs_err", "max_rel_err", "one_thousandth", "five_thousandths")
    return dict(zip(names, values))


def _comparator():
    from msprobe.pytorch.api_accuracy_checker.compare.compare import Comparator

    comparator = object.__new__(Comparator)  # its __init__ writes CSV files; the registry is all we need
    comparator.registry = comparator._register_compare_func()
    return comparator


def benchmark_metrics(golden: torch.Tensor, device: torch.Tensor, api_name: str) -> dict[str, float]:
    """One side's benchmark metrics against the golden, by acc_check's
    ``Comparator._compare_torch_tensor`` (which converts bf16 outputs *and* the golden to float32 and
    runs ``precision_standard/benchmark_compare.py::BenchmarkCompare``)."""
    from msprobe.pytorch.api_accuracy_checker.compare.compare_column import CompareColumn

    column = CompareColumn()
    _comparator()._compare_torch_tensor(api_name, golden.detach().clone(), device.detach().clone(), column, False)
    return {"small_value_err_ratio": column.small_value_err_ratio, "rmse": column.rmse,
            "max_rel_error": column.max_rel_error, "mean_rel_error": column.mean_rel_error, "eb": column.eb}


def benchmark_verdict(npu: dict[str, float], gpu: dict[str, float], dtype: torch.dtype, api_name: str) -> str:
    """msprobe's benchmark verdict (``"pass"`` or ``"error"``) of an NPU and a GPU side, by
    ``benchmark_compare.py::BenchmarkPrecisionCompare`` as ``api_precision_compare.py`` calls it."""
    from msprobe.pytorch.api_accuracy_checker.compare.api_precision_compare import ApiPrecisionCompareColumn
    from msprobe.pytorch.api_accuracy_checker.compare.compare_column import ApiPrecisionOutputColumn
    from msprobe.pytorch.api_accuracy_checker.compare.compare_input import PrecisionCompareInput
    from msprobe.pytorch.api_accuracy_checker.precision_standard.benchmark_compare import BenchmarkPrecisionCompare

    names = {"small_value_err_ratio": ApiPrecisionCompareColumn.SMALL_VALUE_ERROR_RATE,
             "rmse": ApiPrecisionCompareColumn.RMSE, "max_rel_error": ApiPrecisionCompareColumn.MAX_REL_ERR,
             "mean_rel_error": ApiPrecisionCompareColumn.MEAN_REL_ERR, "eb": ApiPrecisionCompareColumn.EB}
    row_npu = {names[k]: float(v) for k, v in npu.items()}
    row_gpu = {names[k]: float(v) for k, v in gpu.items()}
    data = PrecisionCompareInput(row_npu, row_gpu, str(dtype), ApiPrecisionOutputColumn(), api_name=api_name)
    return BenchmarkPrecisionCompare(data).compare()
