"""How two computations are judged: metrics and verdicts over tensors and nested outputs.

``compare(actual, expected, policy)`` walks both structures (tensors, numbers, ``None``, tuples,
lists, dicts and Hugging Face ``ModelOutput``), pairs their leaves by path (``logits``,
``last_hidden_state[1]``, ``["loss"]``) and measures every pair in float64 on the CPU:

* ``max_abs``  — max |a − e|
* ``max_rel``  — max |a − e| / (|e| + eps), eps = 1e-10 (msprobe's relative error)
* ``rel_l2``   — ‖a − e‖₂ / ‖e‖₂ (0 when both are 0, inf when only e is 0)
* ``cosine``   — ⟨a, e⟩ / (‖a‖₂ ‖e‖₂) (1 when both are all-zero, 0 when only one is)
* ``mismatched`` — elements with |a − e| > atol + rtol·|e| (the allclose rule), plus every position
  where NaN/±Inf differ between the two sides (NaN in the same place on both sides is parity)
* ``err_ratio`` — max over elements of |a − e| / (atol + rtol·|e|): > 1 means out of tolerance

A leaf passes when shapes and dtypes agree and ``mismatched <= floor(budget · numel)``.
Finite metrics are taken over positions finite on both sides. Complex tensors are compared as
their real view (``torch.view_as_real``).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from .policy import Tolerance, default_for_dtype

#: Guard in the relative error's denominator, as in msprobe's max relative error.
REL_EPS = 1e-10


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
    element differs. Errors are in the tensor's units (abs) or dimensionless (rel, ratio).
    ``problem`` explains a structural failure (missing leaf, shape or dtype mismatch); metrics are
    NaN then.
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
    actual_at_abs: float | None = None
    expected_at_abs: float | None = None
    problem: str | None = None

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


def _assert_close_header(leaf: LeafResult) -> list[str]:
    where = f"output {leaf.path!r}: " if leaf.path else ""
    if leaf.problem is not None:
        return [f"{where}{leaf.problem}"]
    tol = leaf.tolerance
    pct = 100.0 * leaf.mismatched_frac
    lines = [
        f"{where}Mismatched elements: {leaf.mismatched} / {leaf.numel} ({pct:.1f}%)"
        f" (up to {leaf.allowed} allowed by budget {tol.budget:g})",
    ]
    if leaf.nonfinite_mismatched:
        lines.append(f"NaN/Inf positions differ at {leaf.nonfinite_mismatched} elements")
    if leaf.abs_index is not None:
        lines.append(
            f"Greatest absolute difference: {leaf.max_abs:.6g} at index {_fmt_index(leaf.abs_index)}"
            f" (up to {tol.atol:g} allowed; actual {leaf.actual_at_abs:.9g}, expected {leaf.expected_at_abs:.9g})"
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

    Leaves are tensors, Python numbers (as 0-d tensors) and ``None``. Containers are mappings
    (including ``transformers`` ``ModelOutput``, whose ``None`` fields are skipped as its
    ``to_tuple`` does), tuples and lists.

    Raises:
        TypeError: for any other object, naming its path and type.
    """
    if obj is None or isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, bool | int | float):
        yield prefix, torch.tensor(obj)
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            if value is None and _is_model_output(obj):
                continue
            yield from flatten(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, Sequence) and not isinstance(obj, str | bytes):
        for i, value in enumerate(obj):
            yield from flatten(value, f"{prefix}[{i}]")
    else:
        where = f"at {prefix!r}" if prefix else "at the top level"
        raise TypeError(
            f"cannot compare a {type(obj).__name__} {where}: outputs must be tensors, numbers, None, "
            "or tuples/lists/dicts/ModelOutputs of them"
        )


def _is_model_output(obj: Any) -> bool:
    return any(cls.__name__ == "ModelOutput" for cls in type(obj).__mro__)


# --------------------------------------------------------------------------------------------
# metrics


def _index(flat: int, shape: torch.Size) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        index.append(flat % size)
        flat //= size
    return tuple(reversed(index))


def compare_tensors(actual: torch.Tensor, expected: torch.Tensor, tolerance: Tolerance, path: str = "") -> LeafResult:
    """Measure one pair of tensors (any devices and dtypes) under ``tolerance``.

    Shapes must be equal and dtypes must be equal; otherwise the leaf fails with ``problem`` set.
    Metrics are computed in float64 on the CPU (complex as real views), so they are exact for
    fp32/bf16/fp16 inputs.
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
    if leaf.numel == 0:
        leaf.max_abs = leaf.max_rel = leaf.rel_l2 = leaf.err_ratio = 0.0
        leaf.cosine = 1.0
        return leaf

    a = _as_float64(actual)
    e = _as_float64(expected)
    shape = a.shape
    a, e = a.reshape(-1), e.reshape(-1)

    finite_a, finite_e = torch.isfinite(a), torch.isfinite(e)
    both_finite = finite_a & finite_e
    if bool(both_finite.all()):
        nonfinite_bad = None
        diff = (a - e).abs_()
        ea, eb = a, e
    else:
        # NaN/Inf parity: special values must sit in the same places with the same kind.
        same_special = (torch.isnan(a) & torch.isnan(e)) | ((~finite_a) & (a == e))
        nonfinite_bad = ~both_finite & ~same_special
        leaf.nonfinite_mismatched = int(nonfinite_bad.sum())
        ea = torch.where(both_finite, a, 0.0)
        eb = torch.where(both_finite, e, 0.0)
        diff = (ea - eb).abs_()

    abs_e = eb.abs()
    allowed = abs_e * tolerance.rtol + tolerance.atol
    out = diff > allowed
    if nonfinite_bad is not None:
        out |= nonfinite_bad
    leaf.mismatched = int(out.sum())

    i_abs = int(diff.argmax())
    leaf.max_abs = float(diff[i_abs])
    rel = diff / (abs_e + REL_EPS)
    i_rel = int(rel.argmax())
    leaf.max_rel = float(rel[i_rel])
    if leaf.max_abs > 0:
        leaf.abs_index, leaf.rel_index = _index(i_abs, shape), _index(i_rel, shape)
        leaf.actual_at_abs, leaf.expected_at_abs = float(a[i_abs]), float(e[i_abs])
    ratio = diff / allowed if tolerance.atol > 0 else torch.where(diff > 0, diff / allowed, 0.0)
    leaf.err_ratio = float(ratio.max()) if nonfinite_bad is None or leaf.nonfinite_mismatched == 0 else math.inf

    norm_d = float(torch.linalg.vector_norm(ea - eb))
    norm_e = float(torch.linalg.vector_norm(eb))
    norm_a = float(torch.linalg.vector_norm(ea))
    leaf.rel_l2 = norm_d / norm_e if norm_e > 0 else (0.0 if norm_d == 0 else math.inf)
    if norm_a == 0 and norm_e == 0:
        leaf.cosine = 1.0
    elif norm_a == 0 or norm_e == 0:
        leaf.cosine = 0.0
    else:
        leaf.cosine = float(torch.dot(ea, eb)) / (norm_a * norm_e)
    return leaf


def _as_float64(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    return t.to(device="cpu", dtype=torch.float64)


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
    """
    result = CompareResult(name=name)
    got = dict(flatten(actual))
    want = dict(flatten(expected))
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


def _tolerance_for(leaf: torch.Tensor | None, policy: Tolerance | None) -> Tolerance:
    if leaf is None:
        return policy or default_for_dtype(torch.float32)
    if not (leaf.dtype.is_floating_point or leaf.dtype.is_complex):
        return default_for_dtype(leaf.dtype)  # exact
    return policy if policy is not None else default_for_dtype(leaf.dtype)
