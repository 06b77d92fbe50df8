"""How two computations are judged: metrics and verdicts over tensors and nested outputs.

``compare(actual, expected, policy)`` walks both structures (tensors, numbers, ``None``, tuples,
lists, dicts, Hugging Face ``ModelOutput`` and key/value caches, see ``flatten``), pairs their leaves
by path (``logits``, ``hidden_states[1]``, ``[0].loss``, ``past_key_values.layers[0].keys``) and
measures every pair in float64 on the CPU:

* ``max_abs``  — max |a − e|
* ``max_rel``  — max |a − e| / (|e| + 1e-10) in float64 (``REL_EPS``; our definition: one eps for
  every dtype, so an element where e = 0 shows |a|·1e10. msprobe's ``MaxRelativeErr`` is another
  number, see ``MsprobeView``)
* ``rel_l2``   — ‖a − e‖₂ / ‖e‖₂ (0 when both are 0, inf when only e is 0)
* ``cosine``   — ⟨a, e⟩ / (‖a‖₂ ‖e‖₂), unrounded (1 when both are all-zero, 0 when only one is;
  msprobe says 1.0 and "Nan" there and rounds to 6 decimals above 0.9999, see ``MsprobeView``)
* ``mismatched`` — elements with |a − e| > atol + rtol·|e| (the ``torch.isclose`` rule), plus every
  position where NaN/±Inf differ between the two sides (NaN in the same place on both sides is
  parity, and so is ±Inf of the same sign)
* ``err_ratio`` — max over elements of |a − e| / (atol + rtol·|e|): > 1 means out of tolerance
  (``inf`` when a NaN/Inf position differs, 0/0 counts as 0)

A leaf passes when shapes and dtypes agree and ``mismatched <= floor(budget · numel)``. That NaN/Inf
rule is ours and stricter than msprobe's dump compare, which treats −Inf against +Inf at one place as
equal (``core/compare/npy_compare.py::handle_inf_nan`` compares only the Inf and NaN masks) and
gives no numbers at all when the masks differ.

The same blockwise pass also computes ``MsprobeView``: the six columns of msprobe's dump-compare
CSV (``msprobe -f pytorch compare``, mindstudio-probe 26.2.0) with msprobe's own conventions, so a
report can be read next to an msprobe CSV.
Finite metrics are taken over positions finite on both sides. For complex tensors |·| is the
modulus (as in ``torch.isclose``) and the cosine is Re⟨a, e⟩ / (‖a‖₂ ‖e‖₂).

Large tensors are measured in cache-sized blocks, shared over threads, so the extra memory does not
grow with the tensor (a 64 Mi-element fp32 pair costs about four plain copies of CPU time).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from .policy import Tolerance, default_for_dtype

#: Guard in the denominator of our relative error ``max_rel`` = max |a − e| / (|e| + REL_EPS), the
#: same for every dtype. (msprobe 26.2.0 uses no such constant: its dump compare divides by |b| and
#: adds finfo.eps to both sides only where b = 0, see ``MsprobeView``.)
REL_EPS = 1e-10

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


class ParityError(AssertionError):
    """A parity check failed; ``result`` holds the ``CompareResult`` with every leaf's metrics."""

    def __init__(self, message: str, result: "CompareResult"):
        super().__init__(message)
        self.result = result


@dataclass
class LeafResult:
    """Metrics and verdict of one output leaf.

    ``shape``/``dtype`` are the actual (target) side's, ``expected_shape``/``expected_dtype`` the
    reference's. ``index`` fields are tuples into the tensor (``()`` for 0-d) or ``None`` when no
    element differs: ``abs_index``/``rel_index`` locate the greatest absolute/relative difference
    among positions finite on both sides, ``nonfinite_index`` the first (row-major) position whose
    NaN/±Inf status differs; ``actual_at_*``/``expected_at_*`` are the two values there. Errors are
    in the tensor's units (abs) or dimensionless (rel, ratio). ``problem`` explains a structural
    failure (missing leaf, None vs tensor, shape or dtype mismatch); metrics are NaN then.
    ``msprobe`` is the same pair as msprobe's dump compare sees it (``MsprobeView``; None when there
    is a structural problem or the dtype is complex, which msprobe does not compare).
    """

    path: str
    tolerance: Tolerance
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    expected_shape: tuple[int, ...] | None = None
    expected_dtype: str | None = None
    numel: int = 0
    max_abs: float = math.nan
    max_rel: float = math.nan
    rel_l2: float = math.nan
    cosine: float = math.nan
    err_ratio: float = math.nan
    mismatched: int = 0
    nonfinite_mismatched: int = 0
    abs_index: tuple[int, ...] | None = None
    rel_index: tuple[int, ...] | None = None
    actual_at_abs: float | complex | None = None
    expected_at_abs: float | complex | None = None
    nonfinite_index: tuple[int, ...] | None = None
    actual_at_nonfinite: float | complex | None = None
    expected_at_nonfinite: float | complex | None = None
    problem: str | None = None
    msprobe: MsprobeView | None = None

    @property
    def allowed(self) -> int:
        """Out-of-tolerance elements this leaf may have under its budget."""
        return self.tolerance.allowed_mismatches(self.numel)

    @property
    def mismatched_frac(self) -> float:
        """``mismatched / numel`` (0 for empty tensors)."""
        return self.mismatched / self.numel if self.numel else 0.0

    @property
    def passed(self) -> bool:
        """The verdict: no structural problem and no more mismatches than the budget allows."""
        return self.problem is None and self.mismatched <= self.allowed

    def to_row(self) -> dict[str, Any]:
        """A flat, JSON-able dict of this leaf (for reports and tables)."""
        return {
            "leaf": self.path,
            "shape": "x".join(map(str, self.shape)) if self.shape is not None else None,
            "dtype": self.dtype,
            "numel": self.numel,
            "max_abs": self.max_abs,
            "max_rel": self.max_rel,
            "rel_l2": self.rel_l2,
            "cosine": self.cosine,
            "err_ratio": self.err_ratio,
            "mismatched": self.mismatched,
            "mismatched_frac": self.mismatched_frac,
            "nonfinite_mismatched": self.nonfinite_mismatched,
            "rtol": self.tolerance.rtol,
            "atol": self.tolerance.atol,
            "budget": self.tolerance.budget,
            "tolerance_source": self.tolerance.source,
            "tolerance_reason": self.tolerance.reason,
            "problem": self.problem,
            **(self.msprobe.to_row() if self.msprobe is not None else {}),
            "verdict": "pass" if self.passed else "fail",
        }


@dataclass
class CompareResult:
    """All leaves of one comparison. ``passed`` is True when every leaf passes."""

    name: str
    leaves: list[LeafResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(leaf.passed for leaf in self.leaves)

    @property
    def failures(self) -> list[LeafResult]:
        return [leaf for leaf in self.leaves if not leaf.passed]

    def __bool__(self) -> bool:  # `assert compare(...)` reads naturally
        return self.passed

    def format(self, context: str = "") -> str:
        """The failure message: an assert_close-style header for the worst leaf plus a metrics table.

        ``context`` (e.g. "recipe fp32, target cpu vs baseline recorded on …") goes on the first line.
        """
        failures = self.failures
        verdict = "failed" if failures else "passed"
        lines = [f"Parity check {self.name!r} {verdict}" + (f" ({context})" if context else "")]
        if failures:
            worst = max(failures, key=_severity)
            lines += _assert_close_header(worst)
        lines.append("")
        lines += format_table(failures or self.leaves)
        return "\n".join(lines)

    def raise_if_failed(self, context: str = "") -> None:
        """Raise ``ParityError`` with ``format(context)`` when any leaf failed."""
        if not self.passed:
            raise ParityError(self.format(context), self)


def _severity(leaf: LeafResult) -> float:
    if leaf.problem is not None:
        return math.inf
    return leaf.err_ratio if not math.isnan(leaf.err_ratio) else math.inf


def _fmt_index(index: tuple[int, ...] | None) -> str:
    return "()" if index == () else str(index)


def _fmt_value(value: float | int | complex | None) -> str:
    """Nine significant digits (enough to tell fp32 neighbours apart); integers in full."""
    return str(value) if isinstance(value, int) else f"{value:.9g}"


def _fmt_pct(frac: float) -> str:
    """``0.1%`` style, but never ``0.0%`` for a non-zero share (1 element in 64 Mi is 1.5e-06%)."""
    pct = 100.0 * frac
    return f"{pct:.1f}%" if pct == 0 or pct >= 0.1 else f"{pct:.2g}%"


def _assert_close_header(leaf: LeafResult) -> list[str]:
    where = f"output {leaf.path!r}: " if leaf.path else ""
    if leaf.problem is not None:
        return [f"{where}{leaf.problem}"]
    tol = leaf.tolerance
    lines = [
        f"{where}Mismatched elements: {leaf.mismatched} / {leaf.numel} ({_fmt_pct(leaf.mismatched_frac)})"
        f" (up to {leaf.allowed} allowed by budget {tol.budget:g})",
    ]
    if leaf.nonfinite_mismatched:
        n = leaf.nonfinite_mismatched
        lines.append(
            f"NaN/Inf positions differ at {n} element{'s' if n > 1 else ''}, first at index"
            f" {_fmt_index(leaf.nonfinite_index)} (actual {_fmt_value(leaf.actual_at_nonfinite)},"
            f" expected {_fmt_value(leaf.expected_at_nonfinite)})"
        )
    if leaf.abs_index is not None:
        lines.append(
            f"Greatest absolute difference: {leaf.max_abs:.6g} at index {_fmt_index(leaf.abs_index)}"
            f" (up to {tol.atol:g} allowed; actual {_fmt_value(leaf.actual_at_abs)},"
            f" expected {_fmt_value(leaf.expected_at_abs)})"
        )
    if leaf.rel_index is not None:
        lines.append(
            f"Greatest relative difference: {leaf.max_rel:.6g} at index {_fmt_index(leaf.rel_index)}"
            f" (up to {tol.rtol:g} allowed)"
        )
    return lines


_COLUMNS = ("leaf", "shape", "dtype", "max_abs", "max_rel", "rel_l2", "cosine", "mismatched", "err/tol", "tolerance")


def format_table(leaves: list[LeafResult]) -> list[str]:
    """Fixed-width text table of ``leaves`` (one line each), as printed in failure messages."""
    rows = [_COLUMNS]
    for leaf in leaves:
        shape = "x".join(map(str, leaf.shape)) if leaf.shape is not None else "-"
        if leaf.problem is not None:
            rows.append((leaf.path or "<output>", shape, leaf.dtype or "-", "-", "-", "-", "-", "-", "-", leaf.problem))
            continue
        rows.append((
            leaf.path or "<output>", shape, leaf.dtype or "-",
            f"{leaf.max_abs:.3g}", f"{leaf.max_rel:.3g}", f"{leaf.rel_l2:.3g}", f"{leaf.cosine:.7f}",
            f"{leaf.mismatched}/{leaf.numel}", f"{leaf.err_ratio:.3g}", leaf.tolerance.describe(),
        ))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(_COLUMNS))]
    return ["  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


# --------------------------------------------------------------------------------------------
# structure


def flatten(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Yield ``(path, leaf)`` for every leaf of a nested output.

    Leaves are tensors, Python numbers, strings and ``None``. Numbers become 0-d tensors that hold
    them exactly: ``bool`` → bool, ``int`` → int64, ``float`` → float64, ``complex`` → complex128;
    a ``str`` becomes the 1-d uint8 tensor of its UTF-8 bytes (so it is compared exactly, and stored
    in a baseline like any leaf). Containers are mappings (including ``transformers``
    ``ModelOutput``, whose ``None`` fields are skipped as its ``to_tuple`` does), named tuples and
    dataclass instances (by field name), tuples, lists and Hugging Face key/value caches (see
    ``cache_fields``: ``GenerateDecoderOnlyOutput.past_key_values`` gives
    ``past_key_values.layers[0].keys``, ``…layers[0].values``, … per layer). Paths join mapping keys
    and field names with ``.`` and sequence positions as ``[i]``: ``{"a": (x, {"b": y})}`` gives
    ``a[0]`` and ``a[1].b``; a ``Forecast(mean, samples)`` dataclass or named tuple gives ``mean`` and
    ``samples``. ``torch.return_types`` values (``torch.max(x, 1)``) have no field names there and
    stay positional.

    Raises:
        TypeError: for any other object, naming its path and type.
    """
    if obj is None or isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, bool | int | float | complex):
        yield prefix, _number_tensor(obj, prefix)
    elif isinstance(obj, str):
        yield prefix, torch.tensor(list(obj.encode("utf-8")), dtype=torch.uint8)
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            if value is None and _is_model_output(obj):
                continue
            yield from flatten(value, f"{prefix}.{key}" if prefix else str(key))
    elif (named := _named_fields(obj)) is not None:
        for key, value in named:
            yield from flatten(value, f"{prefix}.{key}" if prefix else key)
    elif isinstance(obj, Sequence) and not isinstance(obj, str | bytes):
        for i, value in enumerate(obj):
            yield from flatten(value, f"{prefix}[{i}]")
    elif (fields := cache_fields(obj)) is not None:
        for key, value in fields.items():
            yield from flatten(value, f"{prefix}.{key}" if prefix else key)
    else:
        where = f"at {prefix!r}" if prefix else "at the top level"
        raise TypeError(
            f"cannot compare a {type(obj).__name__} {where}: outputs must be tensors, numbers, strings, None, "
            "or tuples/lists/dicts/named tuples/dataclasses/ModelOutputs/Hugging Face caches of them"
        )


def _named_fields(obj: Any) -> list[tuple[str, Any]] | None:
    """``[(field name, value)]`` of a named tuple (``collections.namedtuple``, ``typing.NamedTuple``)
    or a dataclass instance, in declaration order; None for anything else."""
    fields = getattr(type(obj), "_fields", None)
    if isinstance(obj, tuple) and isinstance(fields, tuple) and all(isinstance(f, str) for f in fields):
        return list(zip(fields, obj))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    return None


def is_cache(obj: Any) -> bool:
    """Whether ``obj`` is a Hugging Face key/value cache: an instance of a class named ``Cache`` or
    of a subclass (``transformers.cache_utils``: ``DynamicCache``, ``StaticCache``,
    ``EncoderDecoderCache``, …), recognized by its class names so that transformers is never
    imported here. A cache is state: a call given one adds its keys and values to it."""
    return any(cls.__name__ == "Cache" for cls in type(obj).__mro__)


def cache_fields(obj: Any) -> dict[str, Any] | None:
    """The contents of a Hugging Face key/value cache as a plain structure, or None for any other object.

    A cache is an instance of a class named ``Cache`` or of a subclass (``transformers.cache_utils``:
    ``DynamicCache``, ``StaticCache``, ``EncoderDecoderCache``, …), recognized by its class names so
    that transformers is never imported here. Read from transformers 4.57's classes
    (``cache_utils.Cache.__init__``, ``CacheLayerMixin.__init__``, ``EncoderDecoderCache.__init__``):

    * an encoder-decoder cache: ``{"self_attention_cache": …, "cross_attention_cache": …}``;
    * a cache of layers (``Cache.layers``, transformers >= 4.56): ``{"layers": [layer, …]}``, each
      layer as ``{"keys": …, "values": …}`` followed by its other tensor attributes in name order
      (``[batch, heads, tokens, head_dim]`` tensors; ``None`` for a layer not yet filled), so a
      quantized layer's stored tensors are compared too;
    * the older list layout (``key_cache`` / ``value_cache`` lists, transformers < 4.56):
      ``{"key_cache": [...], "value_cache": [...]}``.

    Raises:
        TypeError: a ``Cache`` with none of these layouts, naming its class.
    """
    if not is_cache(obj):
        return None
    if hasattr(obj, "self_attention_cache") and hasattr(obj, "cross_attention_cache"):
        return {"self_attention_cache": obj.self_attention_cache, "cross_attention_cache": obj.cross_attention_cache}
    layers = getattr(obj, "layers", None)
    if isinstance(layers, Sequence):
        return {"layers": [_cache_layer_fields(layer) for layer in layers]}
    keys, values = getattr(obj, "key_cache", None), getattr(obj, "value_cache", None)
    if isinstance(keys, Sequence) and isinstance(values, Sequence):
        return {"key_cache": list(keys), "value_cache": list(values)}
    raise TypeError(f"cannot compare a {type(obj).__name__}: a cache without layers or key_cache/value_cache "
                    "lists; compare its tensors yourself (parity.compare) or run with use_cache=False")


def _cache_layer_fields(layer: Any) -> Any:
    """``{"keys", "values", other tensor attributes in name order}`` of one cache layer (a layer
    that is itself a tuple or list, ``(keys, values)``, is returned as it is)."""
    if isinstance(layer, Sequence):
        return layer
    state = vars(layer) if hasattr(layer, "__dict__") else {}
    fields = {"keys": getattr(layer, "keys", None), "values": getattr(layer, "values", None)}
    for name in sorted(state):
        if name not in fields and isinstance(state[name], torch.Tensor):
            fields[name] = state[name]
    for name in ("keys", "values"):  # a layer class whose keys/values are not tensors: leave them out
        if fields[name] is not None and not isinstance(fields[name], torch.Tensor):
            del fields[name]
    return fields


def _number_tensor(value: bool | int | float | complex, path: str) -> torch.Tensor:
    for kind, dtype in ((bool, torch.bool), (int, torch.int64), (float, torch.float64), (complex, torch.complex128)):
        if isinstance(value, kind):
            break
    try:
        return torch.tensor(value, dtype=dtype)
    except (OverflowError, RuntimeError, ValueError) as exc:  # an int beyond int64
        raise ValueError(f"cannot compare the number {value!r} at {path or 'the top level'!r}: {exc}") from None


def _is_model_output(obj: Any) -> bool:
    return any(cls.__name__ == "ModelOutput" for cls in type(obj).__mro__)


# --------------------------------------------------------------------------------------------
# metrics


def _index(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The multi-dimensional index of row-major position ``flat`` in ``shape``."""
    index = []
    for size in reversed(shape):
        index.append(flat % size)
        flat //= size
    return tuple(reversed(index))


#: Elements per block of the float64 work: the four work arrays (224 KiB each) stay in a core's L2
#: cache, and a block is below torch's 32768-element grain, so no op of the block opens an
#: OpenMP parallel region (each such region costs milliseconds on a busy machine). Large tensors
#: are shared over threads block-wise instead (see ``_accumulate``).
BLOCK = 28 * 1024

#: Elements per block in a worker thread whose torch ops are pinned to one intra-op thread (see
#: ``_accumulate``): no op opens a parallel region whatever its size, so blocks can be larger and
#: the per-op overhead (~17 torch calls a block) is paid 4.6x less often. Measured on a 256 MiB
#: fp32 pair with 2 cores: 1.8x the time of copying the pair (2.0x with both cores busy), against
#: 2.9-3.5x with ``BLOCK`` (larger blocks in unpinned threads were 2.7x slower under load).
WORKER_BLOCK = 128 * 1024

#: A tensor is split over threads only when every thread gets at least this many ``BLOCK``s.
PARALLEL_MIN_BLOCKS = 8

#: At most this many threads: each block holds the GIL for ~1/6 of its time (the Python side of
#: its ~17 torch calls), so more threads than this would only queue for the GIL.
MAX_THREADS = 8


class _Accumulator:
    """Running metrics over the blocks of one flattened pair (see ``compare_tensors``).

    Maxima keep the first flat index where they occur, as ``torch.argmax`` does. Besides our
    metrics it keeps what ``MsprobeView`` needs: Σa·e, msprobe's max relative error and its counts
    below 0.001 / 0.005 (``rel_dtype``: the type msprobe computes its relative error in), and the
    number of positions whose Inf or NaN status differs.
    """

    def __init__(self, tolerance: Tolerance, block: int, work_dtype: torch.dtype,
                 rel_dtype: torch.dtype | None = None):
        self.rtol, self.atol = tolerance.rtol, tolerance.atol
        self.block = block
        self.sum_dd = self.sum_ee = self.sum_aa = 0.0  # Σ|a−e|², Σ|e|², Σ|a|² (finite positions)
        self.max_abs = self.max_rel = self.max_ratio = -1.0
        self.abs_at = self.rel_at = 0
        self.mismatched = 0
        self.nonfinite_mismatched = 0
        self.nonfinite_at: int | None = None
        # msprobe view (rel_dtype None: not computed, e.g. complex)
        self.rel_dtype = rel_dtype
        self.sum_ae = 0.0
        self.ms_max_rel = 0.0
        self.ms_below = [0, 0]  # elements with msprobe relative error < 0.001, < 0.005
        self.ms_special_mismatched = 0  # positions where isinf or isnan differs
        if rel_dtype is not None:
            self.ms_eps = torch.finfo(rel_dtype).eps
            # thresholds as msprobe compares them: in rel_dtype (NumPy casts the Python float scalar)
            self.ms_thresholds = [torch.tensor(t, dtype=rel_dtype).item() for t in (MSPROBE_THOUSANDTH, MSPROBE_FIVE_THOUSANDTHS)]
            self.ms_work = (torch.empty(block, dtype=rel_dtype), torch.empty(block, dtype=rel_dtype))
            self.ms_stat = torch.empty((), dtype=rel_dtype)
            self.block_ms_max = 0.0
        # Work arrays reused by every block (a fresh allocation per block costs more than the
        # math), and the block's seven scalars, read back in one go.
        self.work = (torch.empty(block, dtype=work_dtype), torch.empty(block, dtype=work_dtype),
                     torch.empty(block, dtype=torch.float64), torch.empty(block, dtype=torch.float64))
        self.stats = torch.zeros(7, dtype=torch.float64)

    def add_block(self, a: torch.Tensor, e: torch.Tensor, start: int) -> None:
        """Fold the 1-D CPU slices ``a``/``e`` (flat positions ``start``…) into the running metrics."""
        k = a.numel()
        work = self.work if k == self.block else tuple(w[:k] for w in self.work)
        a64, e64 = work[0].copy_(a), work[1].copy_(e)  # exact: fp32/bf16/fp16 values are float64s
        d, rel, allowed = self._measure_block(*work)
        norm_a, norm_e, norm_d, max_abs, max_rel, max_ratio, dot = self.stats.tolist()
        if not math.isfinite(norm_a + norm_e):
            # A NaN/Inf somewhere (or float64 squares that overflow): judge special values by
            # position and kind, then measure the positions finite on both sides.
            self._nonfinite(a64.copy_(a), e64.copy_(e), start)
            d, rel, allowed = self._measure_block(*work)
            norm_a, norm_e, norm_d, max_abs, max_rel, max_ratio, dot = self.stats.tolist()

        self.sum_aa += norm_a * norm_a
        self.sum_ee += norm_e * norm_e
        self.sum_dd += norm_d * norm_d
        self.sum_ae += dot
        if max_abs > self.max_abs:
            self.max_abs, self.abs_at = max_abs, start + int(d.argmax())
        if max_rel > self.max_rel:
            self.max_rel, self.rel_at = max_rel, start + int(rel.argmax())
        self.max_ratio = max(self.max_ratio, max_ratio)
        if max_ratio > 1.0:  # some element is out of tolerance: count them by the allclose rule
            self.mismatched += int(torch.count_nonzero(d > allowed))
        if self.rel_dtype is not None:
            self._fold_msprobe(k, self.block_ms_max)

    def _measure_block(self, a64: torch.Tensor, e64: torch.Tensor, t: torch.Tensor, r: torch.Tensor):
        """One block's ‖a‖, ‖e‖, ‖d‖, max of d, rel, ratio and Σa·e into ``self.stats`` (and msprobe's
        relative error, see ``_msprobe_rel``); returns the arrays d = |a − e|, rel and allowed = atol + rtol·|e|
        (``a64``/``e64`` are overwritten)."""
        stats = self.stats
        # Sums of squares by torch's own reduction, not BLAS dot: MKL's threaded dot stalls for
        # milliseconds per call on a busy machine.
        torch.linalg.vector_norm(a64, out=stats[0])
        torch.linalg.vector_norm(e64, out=stats[1])
        if self.rel_dtype is not None:
            torch.sum(torch.mul(a64, e64, out=t), 0, out=stats[6])
            self._msprobe_rel(a64, e64)
        if a64.is_complex():
            d = (a64 - e64).abs()  # modulus, as torch.isclose does for complex
            abs_e = e64.abs()
        else:
            d = a64.sub_(e64).abs_()
            abs_e = e64.abs_()
        torch.linalg.vector_norm(d, out=stats[2])
        torch.amax(d, 0, out=stats[3])
        rel = torch.div(d, torch.add(abs_e, REL_EPS, out=r), out=r)
        torch.amax(rel, 0, out=stats[4])
        allowed = abs_e.mul_(self.rtol).add_(self.atol)  # atol + rtol·|e|, as in torch.isclose
        ratio = torch.div(d, allowed, out=t)
        if self.atol == 0:
            ratio.nan_to_num_(nan=0.0, posinf=math.inf)  # 0/0 where e == 0 and a == e
        torch.amax(ratio, 0, out=stats[5])
        return d, rel, allowed

    def _msprobe_rel(self, a64: torch.Tensor, e64: torch.Tensor) -> torch.Tensor:
        """msprobe's relative error |(n − b) / b| of the block in ``rel_dtype``
        (``core/compare/utils.py::get_relative_err``), its max into ``block_ms_max``; left in ``ms_work[0]``."""
        k = a64.numel()
        n, b = (w[:k] for w in self.ms_work) if k != self.block else self.ms_work
        n.copy_(a64)
        b.copy_(e64)
        rel = torch.sub(n, b, out=n).div_(b).abs_()
        self.block_ms_max = float(torch.amax(rel, 0, out=self.ms_stat))
        if not math.isfinite(self.block_ms_max):  # b == 0 somewhere (or an overflow): msprobe's zero rule
            n.copy_(a64)
            zero = b == 0
            n.add_(zero, alpha=self.ms_eps)  # n[b == 0] += eps, in rel_dtype
            b.add_(zero, alpha=self.ms_eps)
            rel = torch.sub(n, b, out=n).div_(b).abs_()
            self.block_ms_max = float(torch.amax(rel, 0, out=self.ms_stat))
        return rel

    def _fold_msprobe(self, k: int, ms_max_rel: float) -> None:
        self.ms_max_rel = max(self.ms_max_rel, ms_max_rel) if not math.isnan(ms_max_rel) else math.nan
        rel = self.ms_work[0][:k]
        for i, threshold in enumerate(self.ms_thresholds):
            # every element is below the threshold when the max is: no count needed
            self.ms_below[i] += k if ms_max_rel < threshold else int(torch.count_nonzero(rel < threshold))

    def add_range(self, a: torch.Tensor, e: torch.Tensor, starts: range, block: int) -> "_Accumulator":
        """Fold the blocks beginning at ``starts`` (flat positions); returns ``self``."""
        for start in starts:
            self.add_block(a[start:start + block], e[start:start + block], start)
        return self

    def merge(self, later: "_Accumulator") -> None:
        """Fold in the metrics of blocks that come after this accumulator's blocks."""
        self.sum_dd += later.sum_dd
        self.sum_ee += later.sum_ee
        self.sum_aa += later.sum_aa
        self.sum_ae += later.sum_ae
        if later.max_abs > self.max_abs:
            self.max_abs, self.abs_at = later.max_abs, later.abs_at
        if later.max_rel > self.max_rel:
            self.max_rel, self.rel_at = later.max_rel, later.rel_at
        self.max_ratio = max(self.max_ratio, later.max_ratio)
        self.mismatched += later.mismatched
        self.nonfinite_mismatched += later.nonfinite_mismatched
        if self.nonfinite_at is None:
            self.nonfinite_at = later.nonfinite_at
        self.ms_max_rel = max(self.ms_max_rel, later.ms_max_rel) if not math.isnan(later.ms_max_rel) else math.nan
        self.ms_below = [x + y for x, y in zip(self.ms_below, later.ms_below)]
        self.ms_special_mismatched += later.ms_special_mismatched

    def _nonfinite(self, a64: torch.Tensor, e64: torch.Tensor, start: int) -> None:
        finite_a, finite_e = torch.isfinite(a64), torch.isfinite(e64)
        both_finite = finite_a & finite_e
        # NaN in the same place on both sides is parity; so is ±Inf of the same sign.
        same_special = (torch.isnan(a64) & torch.isnan(e64)) | (~finite_a & (a64 == e64))
        bad = ~both_finite & ~same_special
        n_bad = int(torch.count_nonzero(bad))
        if n_bad:
            self.nonfinite_mismatched += n_bad
            self.mismatched += n_bad
            if self.nonfinite_at is None:
                self.nonfinite_at = start + int(bad.to(torch.uint8).argmax())
        if self.rel_dtype is not None:
            # msprobe compares the Inf mask and the NaN mask only (handle_inf_nan): -Inf vs +Inf is equal
            self.ms_special_mismatched += int(torch.count_nonzero(
                (torch.isinf(a64) != torch.isinf(e64)) | (torch.isnan(a64) != torch.isnan(e64))))
        a64.masked_fill_(~both_finite, 0)
        e64.masked_fill_(~both_finite, 0)


def _flat_cpu(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, on the CPU in its own dtype (never converted on the device: NPUs have no
    float64), conjugation resolved, flattened (a copy only when ``t`` is not contiguous)."""
    t = t.detach()
    if t.is_complex():
        t = t.resolve_conj()
    return t.to("cpu").reshape(-1)


def flat_real_cpu(t: torch.Tensor) -> torch.Tensor:
    """``_flat_cpu(t)`` with complex values as interleaved real and imaginary parts (real dtype)."""
    flat = _flat_cpu(t)
    return torch.view_as_real(flat).reshape(-1) if flat.is_complex() else flat


def float64_blocks(*tensors: torch.Tensor, block: int = WORKER_BLOCK) -> Iterator[tuple[torch.Tensor, ...]]:
    """Aligned flat float64 CPU slices of ``tensors`` (same number of elements, any devices and real or
    complex dtypes, see ``flat_real_cpu``), ``block`` elements at a time, so a reduction over large
    tensors holds a few blocks of float64 instead of whole float64 copies.

    Raises:
        ValueError: when the tensors do not have the same number of elements.
    """
    flats = [flat_real_cpu(t) for t in tensors]
    n = flats[0].numel() if flats else 0
    if any(f.numel() != n for f in flats):
        raise ValueError(f"blockwise reduction over tensors of {[f.numel() for f in flats]} elements: they must be equal")
    for start in range(0, n, block):
        yield tuple(f[start:start + block].to(torch.float64) for f in flats)


def _scalar(t: torch.Tensor, i: int) -> float | int | complex:
    return t[i].item()  # Python float, int, bool or complex: exact for every dtype


def compare_tensors(actual: torch.Tensor, expected: torch.Tensor, tolerance: Tolerance, path: str = "") -> LeafResult:
    """Measure one pair of tensors (any devices, any shapes) under ``tolerance``.

    Args:
        actual: the target's tensor.
        expected: the reference's tensor.
        tolerance: rtol/atol/budget for this leaf.
        path: the leaf's name in its output structure (for messages).

    Returns:
        A ``LeafResult``. Shapes and dtypes must be equal; otherwise the leaf fails with ``problem``
        set and NaN metrics. Metrics are computed on the CPU in float64 (complex128 for complex
        inputs), block by block (``BLOCK`` elements, on several threads for large tensors), so
        every fp32/bf16/fp16 value enters exactly and the differences, ratios and the allclose
        rule are evaluated in float64; norms are float64 reductions, and the cosine is derived
        from ‖a‖, ‖e‖ and ‖a − e‖ (which keeps 1 − cosine accurate when a ≈ e). Integer and bool
        tensors under an exact tolerance (rtol = atol = 0) are judged by ``actual != expected``
        in their own dtype, so int64 values beyond 2**53 are compared exactly too (their other
        metrics are float64 approximations). Bitwise-equal pairs take a one-pass shortcut.
        Float64 inputs beyond ~1e154 overflow the float64 norms (rel_l2/cosine become inf/NaN;
        the verdict is unaffected).
    """
    leaf = LeafResult(
        path=path, tolerance=tolerance,
        shape=tuple(actual.shape), dtype=str(actual.dtype).removeprefix("torch."),
        expected_shape=tuple(expected.shape), expected_dtype=str(expected.dtype).removeprefix("torch."),
        numel=expected.numel(),
    )
    if actual.shape != expected.shape:
        leaf.problem = f"shape mismatch: actual {tuple(actual.shape)} vs expected {tuple(expected.shape)}"
        return leaf
    if actual.dtype != expected.dtype:
        leaf.problem = f"dtype mismatch: actual {leaf.dtype} vs expected {leaf.expected_dtype}"
        return leaf
    a, e = _flat_cpu(actual), _flat_cpu(expected)
    rel_dtype = msprobe_rel_dtype(a.dtype)
    if leaf.numel == 0 or torch.equal(a, e):
        # Every element equal (NaN never is, so NaN pairs take the full path): nothing differs.
        leaf.max_abs = leaf.max_rel = leaf.rel_l2 = leaf.err_ratio = 0.0
        leaf.cosine = 1.0
        if rel_dtype is not None:
            leaf.msprobe = (MsprobeView.all(MSPROBE_UNSUPPORTED, "empty tensor") if leaf.numel == 0
                            else _msprobe_scalar(a, e) if leaf.numel == 1
                            else MsprobeView(1.0, 0.0, 0.0, 0.0, 1.0, 1.0))
        return leaf

    acc = _accumulate(a, e, tolerance, rel_dtype if leaf.numel > 1 else None)
    if rel_dtype is not None:
        leaf.msprobe = _msprobe_scalar(a, e) if leaf.numel == 1 else _msprobe_view(acc, leaf.numel)

    shape = tuple(actual.shape)
    leaf.mismatched = acc.mismatched
    leaf.nonfinite_mismatched = acc.nonfinite_mismatched
    if acc.nonfinite_at is not None:
        leaf.nonfinite_index = _index(acc.nonfinite_at, shape)
        leaf.actual_at_nonfinite = _scalar(a, acc.nonfinite_at)
        leaf.expected_at_nonfinite = _scalar(e, acc.nonfinite_at)
    leaf.max_abs, leaf.max_rel = acc.max_abs, acc.max_rel
    if acc.max_abs > 0:
        leaf.abs_index, leaf.rel_index = _index(acc.abs_at, shape), _index(acc.rel_at, shape)
        leaf.actual_at_abs, leaf.expected_at_abs = _scalar(a, acc.abs_at), _scalar(e, acc.abs_at)
    leaf.err_ratio = math.inf if acc.nonfinite_mismatched else acc.max_ratio

    if not (a.dtype.is_floating_point or a.is_complex()) and tolerance.rtol == 0 and tolerance.atol == 0:
        _judge_exactly(leaf, a, e, shape)

    norm_d, norm_e, norm_a = math.sqrt(acc.sum_dd), math.sqrt(acc.sum_ee), math.sqrt(acc.sum_aa)
    leaf.rel_l2 = norm_d / norm_e if norm_e > 0 else (0.0 if norm_d == 0 else math.inf)
    if norm_a == 0 and norm_e == 0:
        leaf.cosine = 1.0
    elif norm_a == 0 or norm_e == 0:
        leaf.cosine = 0.0
    else:
        # ⟨a, e⟩ = (‖a‖² + ‖e‖² − ‖a − e‖²) / 2, arranged so that 1 − cosine keeps its digits
        # when a ≈ e (the case that matters): 1 − cos = (‖d‖² − (‖a‖ − ‖e‖)²) / (2‖a‖‖e‖).
        one_minus = (acc.sum_dd - (norm_a - norm_e) ** 2) / (2.0 * norm_a * norm_e)
        leaf.cosine = min(1.0, max(-1.0, 1.0 - one_minus))
    return leaf


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



def _accumulate(a: torch.Tensor, e: torch.Tensor, tolerance: Tolerance,
                rel_dtype: torch.dtype | None = None) -> _Accumulator:
    """Run the blocks of the flat CPU tensors ``a``/``e``, on up to ``torch.get_num_threads()``
    (at most ``MAX_THREADS``) threads for large tensors: each thread a contiguous run of blocks;
    torch ops release the GIL. In the calling thread a block is small enough (``BLOCK``) that no
    op starts its own thread team; worker threads pin their own intra-op thread count to 1 where
    that setting is per thread (the OpenMP backend) and then take ``WORKER_BLOCK``s."""
    numel = a.numel()
    block = min(BLOCK, numel)
    work_dtype = torch.complex128 if a.is_complex() else torch.float64
    starts = range(0, numel, block)
    workers = min(torch.get_num_threads(), MAX_THREADS, len(starts) // PARALLEL_MIN_BLOCKS)
    if workers <= 1:
        return _Accumulator(tolerance, block, work_dtype, rel_dtype).add_range(a, e, starts, block)
    pinned = _per_thread_intra_op()
    if pinned:
        block = min(WORKER_BLOCK, numel)
        starts = range(0, numel, block)
    share = -(-len(starts) // workers)
    runs = [starts[i:i + share] for i in range(0, len(starts), share)]

    def work(run: range) -> _Accumulator:
        if pinned:
            torch.set_num_threads(1)  # this worker thread only (OpenMP keeps it per thread)
        return _Accumulator(tolerance, block, work_dtype, rel_dtype).add_range(a, e, run, block)

    with ThreadPoolExecutor(max_workers=len(runs), thread_name_prefix="npu-parity-compare") as pool:
        parts = list(pool.map(work, runs))
    total = parts[0]
    for part in parts[1:]:
        total.merge(part)
    return total


_PER_THREAD: bool | None = None


def _per_thread_intra_op() -> bool:
    """True when ``torch.set_num_threads`` called in a thread affects that thread only: ATen's
    OpenMP backend (the default of Linux x86 and aarch64 builds) keeps the count in OpenMP's
    per-thread ICV. Checked once by setting it in a throwaway thread and reading it back here."""
    global _PER_THREAD
    if _PER_THREAD is None:
        import threading

        before = torch.get_num_threads()
        if before < 2:  # a probe could not tell (and no worker threads are used): ask again later
            return False
        if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
            _PER_THREAD = False
        else:
            probe = threading.Thread(target=torch.set_num_threads, args=(1,), name="npu-parity-probe")
            probe.start()
            probe.join()
            _PER_THREAD = torch.get_num_threads() == before
            if not _PER_THREAD:
                torch.set_num_threads(before)
    return _PER_THREAD


def _judge_exactly(leaf: LeafResult, a: torch.Tensor, e: torch.Tensor, shape: tuple[int, ...]) -> None:
    """Integer/bool verdict in the tensors' own dtype (float64 rounds int64 beyond 2**53)."""
    differs = a != e
    leaf.mismatched = int(torch.count_nonzero(differs))
    if leaf.mismatched and leaf.abs_index is None:
        # Every difference rounded away in float64: report the first one, computed exactly.
        first = int(differs.to(torch.uint8).argmax())
        leaf.abs_index = leaf.rel_index = _index(first, shape)
        leaf.actual_at_abs, leaf.expected_at_abs = _scalar(a, first), _scalar(e, first)
        leaf.max_abs = float(abs(leaf.actual_at_abs - leaf.expected_at_abs))
        leaf.max_rel = leaf.max_abs / (abs(leaf.expected_at_abs) + REL_EPS)
    if leaf.mismatched:
        leaf.err_ratio = math.inf


def compare(actual: Any, expected: Any, policy: Tolerance | None = None, *, name: str = "") -> CompareResult:
    """Compare two nested outputs leaf by leaf.

    Args:
        actual: the target's output (tensors on any device, or a nested structure of them).
        expected: the reference's output with the same structure.
        policy: the tolerance for every floating-point leaf; ``None`` picks
            ``policy.default_for_dtype`` of each expected leaf. Integer and bool leaves are always
            compared exactly.
        name: the check's name, used in messages.

    Returns:
        A ``CompareResult``; missing/extra leaves and ``None``-vs-tensor pairs are failing leaves
        with ``problem`` set.

    Raises:
        TypeError: when a structure holds something that is not a tensor, number, None or container.
        ValueError: when two leaves of one side get the same path (``{"a.b": x, "a": {"b": y}}``)
            or an integer does not fit int64.
    """
    result = CompareResult(name=name)
    got = _leaves_by_path(actual, "actual")
    want = _leaves_by_path(expected, "expected")
    for path in list(want) + [p for p in got if p not in want]:
        exp_leaf = want.get(path)
        tol = _tolerance_for(exp_leaf if exp_leaf is not None else got.get(path), policy)
        if path not in got:
            result.leaves.append(LeafResult(path=path, tolerance=tol, problem="missing in actual output"))
        elif path not in want:
            result.leaves.append(LeafResult(path=path, tolerance=tol, problem="not in expected output"))
        elif got[path] is None or exp_leaf is None:
            if got[path] is not exp_leaf:
                which = "actual" if got[path] is None else "expected"
                result.leaves.append(LeafResult(path=path, tolerance=tol, problem=f"{which} is None, the other is a tensor"))
        else:
            result.leaves.append(compare_tensors(got[path], exp_leaf, tol, path))
    return result


def _leaves_by_path(obj: Any, side: str) -> dict[str, torch.Tensor | None]:
    leaves: dict[str, torch.Tensor | None] = {}
    for path, leaf in flatten(obj):
        if path in leaves:
            raise ValueError(f"two leaves of the {side} output have the same path {path!r}; rename a key")
        leaves[path] = leaf
    return leaves


def _tolerance_for(leaf: torch.Tensor | None, policy: Tolerance | None) -> Tolerance:
    if leaf is None:
        return policy or default_for_dtype(torch.float32)
    if not (leaf.dtype.is_floating_point or leaf.dtype.is_complex):
        return default_for_dtype(leaf.dtype)  # exact
    return policy if policy is not None else default_for_dtype(leaf.dtype)
