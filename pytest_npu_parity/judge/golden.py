"""The golden policy: judge the target by how far it strays from a higher-precision golden run,
relative to how far the reference strays from the same golden.

An allclose tolerance asks "is the target within ``atol + rtol·|e|`` of the reference?". Between two
legitimate implementations of a bf16 computation the answer is often "no" for many elements (both
carry bf16 rounding error, in different places), and for a fp32 computation a real fault can hide
below the tolerance. The golden policy asks instead: "is the target's error no worse than the
reference's error, within a documented multiple?", both errors measured against a **golden**: the
same computation on the CPU at higher precision.

=============================  ============================  ================================
work (recipe)                  golden                        ``golden_dtypes(recipe)``
=============================  ============================  ================================
``fp32``                       fp64 run on the CPU           ``(torch.float64,)``
``bf16``, ``bf16-weights``     fp64 run on the CPU, else     ``(torch.float64, torch.float32)``
                               fp32 where fp64 cannot run
``fp16``                       the same (an fp16 training    ``(torch.float64, torch.float32)``
                               step: fp32, its ``amp.*``
                               leaves being fp32)
=============================  ============================  ================================

For bf16 work the golden is fp64 as well where the computation runs in fp64: under bf16 autocast
some outputs stay fp32 (layer_norm, softmax, sums; the fp32 op list), and an fp32 golden is no finer
than those outputs — the CPU reference would equal it exactly and any other correct fp32 kernel
would look infinitely worse. Where only an fp32 golden is possible, outputs at least as fine as
the golden are floored at the work dtype's rounding (``judge_golden_tensors``' ``work_dtype``).

The idea is msprobe's "benchmark" comparison (标杆比对法, PyPI ``mindstudio-probe``): NPU and GPU
outputs are each compared with a high-precision CPU golden and the verdict is taken on the ratios
NPU-error / GPU-error. Here the target plays msprobe's NPU and the reference its GPU. Two limit sets
are available:

``golden`` (``limit_set="default"``) — our metrics and limits, as documented since this policy
exists. Metrics of one side ``x`` (target ``a`` or reference ``e``) against the golden ``g``, per
leaf, in float64 over the positions finite on all three tensors (``F``); a golden element is
*small* when ``|g| < small_value_threshold`` and *normal* otherwise:

* ``rmse``       — sqrt(mean over F of (x − g)²)             (tensor units; small values included)
* ``max_rel``    — max over normal of |x − g| / |g|           (dimensionless, no eps)
* ``mean_rel``   — mean over normal of |x − g| / |g|          (dimensionless, no eps)
* ``small_share`` — share of small elements with |x − g| > ``small_value_atol``
* ``max_abs``    — max over F of |x − g|                      (tensor units; ours, judged at the
  ``max_rel`` limit: ``GoldenPolicy.limits`` gives the reason)
* ``balance``    — |#(x > g) − #(x < g)| / #F (reported, not judged)

Ratios are target metric / max(reference metric, floor); 0/0 is 1 (neither side has the error).
The floors are ours: the reference's metric is never taken below the metric of the golden rounded
to the leaf's own dtype (no target can beat correct rounding of its output), and a share never
below one element's worth (1 / number of small elements). Limits: RMSE ratio 2, max relative error
ratio 10, mean relative error ratio 2, small-value share ratio 2 (msprobe's default "L0" limits for
the first three; the small-value limit is msprobe's too). Small-value thresholds (``SMALL_VALUE``):
``|g| < 1e-6``, error ``> 1e-9`` for fp32 work, ``|g| < 1e-3``, error ``> 1e-5`` for fp16/bf16
work — the values msprobe 1.0.3 documented, kept as our own; msprobe 26.2.0 uses others (below).

``golden msprobe [op=NAME]`` (``limit_set="msprobe"``) — msprobe 26.2.0's benchmark standard,
reproduced from its source (paths under ``msprobe/pytorch/api_accuracy_checker/`` of
mindstudio-probe 26.2.0) so that the verdict equals msprobe's on the same tensors:

* per side, ``compare/compare.py::Comparator._compare_torch_tensor`` (a bf16 output and its golden
  are both converted to float32 first) and ``precision_standard/benchmark_compare.py::BenchmarkCompare``
  with ``compare/algorithm.py``: ``abs_err = |x − g|``; small where ``|g| <= 2^-10`` (fp16/bf16) or
  ``2^-20`` (fp32) among positions finite on both (the golden cast to the output's dtype)
  (``standard_config.py::StandardConfig._small_value``); ``small_value_err_ratio`` = share of small
  elements with ``abs_err > 1e-16`` (fp16/bf16) or ``2^-30`` (fp32) (``_benchmark_small_value_atol``);
  relative error ``abs_err / (|g| + eps)`` over the other finite positions, eps ``2^-8`` for bf16,
  else ``finfo(golden).eps`` (``get_abs_bench_with_eps``), giving ``max_rel_error`` and
  ``mean_rel_error``; ``rmse`` over the same positions with msprobe's correction
  ``sqrt(mean(masked²) · (n / (n − k + 1e-4) + 1e-4))`` (``get_rmse``, k = masked count); ``eb``
  (``get_error_balance``, reported only);
* the verdict, ``benchmark_compare.py::BenchmarkPrecisionCompare``: ratio ``|t| / max(|r|, floor)``
  with floor ``2^-8`` (bf16), ``2^-11`` (fp16), ``2^-14`` (fp32) by the target's dtype
  (``algorithm.py::calc_ratio``, ``StandardConfig._minmum_err``); a metric that is NaN/Inf on one
  side only is an error, on both sides alike a pass (``compare_utils.py::check_inf_or_nan``); a
  ratio above its limit is an error, otherwise pass — 26.2.0 has no warning state here. Limits
  (``StandardConfig.get_benchmark_ratio_threshold``): rmse / max_rel / mean_rel ratio 2 / 10 / 2 by
  default ("L0"), 1.5 / 5 / 1.5 for the ops of ``L1_API_LIST`` (embedding, npu_fusion_attention,
  scatter_, …) and 1.2 / 2 / 1.2 for ``L2_API_LIST`` (matmul, mm, addmm, layer_norm, GELU, sum,
  index, npu_rms_norm, …): name the op class with ``op=``; small-value ratio 2 always.
  Thresholds follow each output's own dtype, as in msprobe (an fp32 output of a bf16 recipe is
  judged as fp32). float64 outputs, which msprobe skips, get its "default" (fp32) values.

Both limit sets add our own NaN/Inf rule: NaN/±Inf positions of the target must equal the
reference's (NaN/Inf on one side only fails, and so does −Inf against +Inf). msprobe's benchmark
metrics leave such positions out, so msprobe alone would pass them; ``GoldenLeafResult.msprobe_verdict``
is msprobe's verdict without our rule. An empty tensor passes (msprobe skips it).

A leaf passes when the structure matches (two floating dtypes may differ: autocast's op lists
differ between devices and kernels), the NaN/Inf rule holds and every ratio is within its limit.
Integer and bool leaves, and under fp16 work a loss scaler's ``amp.scale``, are compared exactly (the golden
is not used).

Under ``allclose_floor`` with our limit set, a leaf whose out-of-bound elements the built-in budget
would take (``Tolerance.rounding_budget``: few enough, ``mismatched <= allowed``) fails on a **gross
element** (ours, ``GoldenLeafResult.gross``): one more than ``GROSS_ERR_RATIO`` (16) times outside the
allclose bound whose error against the golden is more than the reference's largest error anywhere in
the leaf and more than the ``max_rel`` limit (10) times the reference's error there and the golden's own
rounding error there. Averages and maxima over a leaf
cannot see such an element: a sign flipped at an output of 0.04 among 4,096 of a bf16 linear moved the
largest absolute error 6.7 times the reference's, and 32 logits of 0.1–0.2 negated in rows holding a
logit of 25.3 moved it 8 times, both within the limits. Left out: a training step's parameters after
the optimizer step (leaves named ``param.<p>`` or ``rank<k>.param.<p>``, as the training steps name them), where AdamW turns a gradient that is rounding
noise into a step of ±lr whose sign the golden's gradient decides; its gradients (``grad.<p>``,
``rank<k>.grad.<p>``), which a ReLU's mask or a max's choice makes discontinuous in the forward's rounding:
a correct fp16 target whose pre-activation near 0 fell on the other side of a ReLU dropped one sample's
share of a weight-gradient row, 16× outside the bound where the reference happened to match the golden;
and complex leaves.

Where the pieces live: the limits and the spec texts are ``judge.golden_policy``; one side's metrics
by our definitions ``judge.golden_metrics``, by msprobe's ``judge.msprobe``; the golden itself is
run by ``runtime.golden_run.GoldenRunner`` (``golden_dtypes`` there: which golden a recipe gets).
This module takes the verdict. ``pytest_npu_parity.golden`` is the old import path of all of them
and re-exports every name.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from ..leaves import _leaves_by_path
from .allclose import (WORKER_BLOCK, CompareResult, LeafResult, _index, compare_tensors, flat_real_cpu, float64_blocks,
                       format_table)
from .golden_metrics import SideMetrics, _SideSums, ratio, segment_sums
from .golden_policy import DEFAULT_GOLDEN, JUDGED_EXTRA, METRICS, GoldenPolicy
from .msprobe import _MsprobeSums, msprobe_ratio
from .tolerance import BUDGET_OUTLIER_ERR_RATIO, EXACT, Tolerance, default_for_dtype


#: How far outside the allclose bound an element the budget lets through may sit for the allclose floor
#: to pass its leaf: ``tolerance.BUDGET_OUTLIER_ERR_RATIO`` (its comment gives the reasoning); the floor
#: holds every budget to it, a user's too, since the floor passes a leaf without the ratio test.
FLOOR_OUTLIER_ERR_RATIO = BUDGET_OUTLIER_ERR_RATIO

#: How far outside the allclose bound (err/tol) an element the built-in budget takes may sit before the
#: golden is asked whether it is rounding (ours): two bf16 rounding steps (one step, 2^-7·|e|, is at most
#: err/tol 7.8 at rtol = atol = 1e-3). Measured (2026-12), the elements the budget took in the Aurora main
#: job against the committed baselines, on this and on another CPU kernel path (ATen default, oneDNN
#: capped at AVX2), and in the bf16 calibration's legitimate variants sat at most 3.9 times outside it.
GROSS_ERR_RATIO = 16.0

#: Leaves that hold a training step's parameters after the optimizer step (``runtime.training``'s
#: ``param.<p>``, the distributed step's ``rank<k>.param.<p>``) or its gradients (``grad.<p>``,
#: ``rank<k>.grad.<p>``): no gross-element test there (see the module docstring).
_STEP_PARAMETER_OR_GRADIENT = re.compile(r"^(rank\d+\.)?(param|grad)\.")
#: The loss scaler's scale after an fp16 training step (``runtime.training``'s ``amp.scale``): a power of two its
#: overflow decisions set, not a rounded result. The golden step (float32: the step's ``amp.*`` leaves are
#: float32, so ``runtime.golden_run`` refuses a float64 one) overflows nowhere, where fp16 does (the tiny Aurora
#: at 2^16), so the golden cannot judge it (a target that missed the overflow matched the golden's 2^16 and
#: passed the ratio test): under fp16 work it is compared exactly, as an integer leaf is. By the leaf's name: a
#: leaf of one's own named ``amp.scale`` in an fp16 check is compared exactly too. (A distributed step refuses
#: loss-scaling recipes, so there is no ``rank<k>.amp.scale``.)
_SCALER_STATE = "amp.scale"


# --------------------------------------------------------------------------------------------
# results


@dataclass
class GoldenLeafResult(LeafResult):
    """A ``LeafResult`` judged by a ``GoldenPolicy``.

    The inherited metrics (``max_abs``, ``rel_l2``, ``cosine``, ``mismatched`` …) are the target
    vs reference ones under ``tolerance`` (informative only: they do not decide the verdict).
    Added fields: ``policy``; ``golden_dtype``; ``target``/``reference``/``floor`` —
    ``SideMetrics`` against the golden (``floor`` is the golden rounded to the leaf's dtype);
    ``ratios`` — ``{metric: target / max(reference, floor)}`` for ``METRICS``;
    ``exact`` — an integer/bool leaf, judged by equality; ``note`` — e.g. that the target's
    floating dtype differs from the reference's (allowed under the golden policy); ``gross`` — the
    number of gross elements (module docstring; 0 where the test does not apply), ``gross_index``
    the first one's index in the leaf and ``gross_values`` its (target, reference, golden) values;
    ``golden_shape`` — under the allclose floor, the golden's shape where it differs from the outputs'
    in its first dimension's length only (a value-dependent shape, ``y[y > t]``: no ratio can be taken,
    the floor alone decides, its outliers held to ``GROSS_ERR_RATIO``), else None.
    """

    policy: GoldenPolicy | None = None
    golden_dtype: str | None = None
    target: SideMetrics | None = None
    reference: SideMetrics | None = None
    floor: SideMetrics | None = None
    ratios: dict[str, float] = field(default_factory=dict)
    exact: bool = False
    note: str | None = None
    gross: int = 0
    gross_index: tuple[int, ...] | None = None
    gross_values: tuple[float, float, float] | None = None
    golden_shape: tuple[int, ...] | None = None

    @property
    def over_limit(self) -> dict[str, float]:
        """``{metric: ratio}`` of the ratios above the policy's limits."""
        if self.policy is None:
            return {}
        limits = self.policy.limits
        if self.policy.msprobe:  # msprobe: a NaN ratio (both sides NaN, or the same Inf) passes
            return {m: r for m, r in self.ratios.items() if r > limits[m]}
        return {m: r for m, r in self.ratios.items() if not r <= limits[m]}

    @property
    def msprobe_verdict(self) -> str | None:
        """msprobe's own benchmark verdict (``"pass"``/``"error"``) under the msprobe limit set,
        without our NaN/Inf rule (None for the default limit set, structural problems, integer
        leaves, and empty tensors, which msprobe skips)."""
        if self.policy is None or not self.policy.msprobe or self.problem is not None or self.exact or not self.numel:
            return None
        return "error" if self.over_limit else "pass"

    @property
    def within_floor(self) -> bool:
        """Under ``allclose_floor``: the target is within the allclose tolerance of the reference, and
        the elements its budget lets outside the bound ``atol + rtol·|reference|`` are at most
        ``FLOOR_OUTLIER_ERR_RATIO`` times outside it (``err_ratio``); a leaf with an element further
        off is left to the ratio test. A leaf whose golden has another shape (``golden_shape``), where no
        golden can vouch for an element, takes them only within ``GROSS_ERR_RATIO`` times the bound."""
        outliers = GROSS_ERR_RATIO if self.golden_shape is not None else FLOOR_OUTLIER_ERR_RATIO
        return (self.policy is not None and self.policy.allclose_floor and self.problem is None
                and self.nonfinite_mismatched == 0 and self.mismatched <= self.allowed and self.gross == 0
                and (self.mismatched == 0 or self.err_ratio <= outliers))

    @property
    def passed(self) -> bool:
        """No structural problem, no NaN/Inf on one side only, no gross element (``gross``), and every
        ratio within its limit or (``allclose_floor``) the leaf within the floor (``within_floor``;
        integer/bool leaves: no differing element; a golden of another shape, ``golden_shape``: the floor)."""
        if self.problem is not None:
            return False
        if self.exact:
            return self.mismatched == 0
        if self.golden_shape is not None:  # the golden's shape differs (a value-dependent shape): the floor decides
            return self.within_floor
        return self.nonfinite_mismatched == 0 and self.gross == 0 and (self.within_floor or not self.over_limit)

    @property
    def worst_ratio(self) -> tuple[str | None, float]:
        """``(metric, ratio / limit)`` of the ratio closest to (or furthest over) its limit."""
        if self.policy is None or not self.ratios:
            return None, math.nan
        limits = self.policy.limits
        metric = max(self.ratios, key=lambda m: -math.inf if math.isnan(self.ratios[m]) else self.ratios[m] / limits[m])
        return metric, self.ratios[metric] / limits[metric]

    def to_row(self) -> dict[str, Any]:
        """``LeafResult.to_row()`` plus ``policy``, ``golden_*`` columns and this verdict."""
        row = super().to_row()
        row["policy"] = "golden"
        row["golden_policy"] = self.policy.describe() if self.policy is not None else None
        row["golden_policy_source"] = self.policy.source if self.policy is not None else None
        row["golden_policy_reason"] = self.policy.reason if self.policy is not None else None
        row["golden_dtype"] = self.golden_dtype
        row["golden_note"] = self.note
        for metric in METRICS + JUDGED_EXTRA:
            measured = metric in self.ratios  # msprobe's limit set does not measure max_abs
            row[f"golden_{metric}_ratio"] = self.ratios.get(metric)
            row[f"golden_{metric}_target"] = getattr(self.target, metric) if self.target and measured else None
            row[f"golden_{metric}_reference"] = getattr(self.reference, metric) if self.reference and measured else None
        row["golden_gross_elements"] = self.gross
        metric, margin = self.worst_ratio
        row["golden_worst_metric"] = metric
        row["golden_worst_margin"] = margin
        row["golden_msprobe_verdict"] = self.msprobe_verdict
        row["verdict"] = "pass" if self.passed else "fail"
        return row


class GoldenCompareResult(CompareResult):
    """``CompareResult`` of ``GoldenLeafResult`` leaves; its message shows the golden ratios."""

    def __init__(self, name: str, policy: GoldenPolicy, leaves: list[LeafResult] | None = None):
        super().__init__(name=name, leaves=list(leaves or []))
        self.policy = policy

    def format(self, context: str = "") -> str:
        """The failure message: a header naming the worst golden ratio, the ratio table, then the
        usual target-vs-reference metrics table (informative)."""
        failures = self.failures
        verdict = "failed" if failures else "passed"
        lines = [f"Parity check {self.name!r} {verdict} under the golden policy"
                 + (f" ({context})" if context else "")]
        lines.append(f"policy: {self.policy.describe()}")
        if failures:
            worst = max(failures, key=_golden_severity)
            lines.append(_golden_header(worst))
        lines.append("")
        lines += format_golden_table(failures or self.leaves)
        lines += ["", "target vs reference (informative):"]
        lines += format_table(failures or self.leaves)
        return "\n".join(lines)


def _golden_severity(leaf: LeafResult) -> float:
    if leaf.problem is not None or leaf.nonfinite_mismatched or getattr(leaf, "gross", 0):
        return math.inf
    if isinstance(leaf, GoldenLeafResult) and not leaf.exact:
        margin = leaf.worst_ratio[1]
        return margin if not math.isnan(margin) else math.inf
    return math.inf if leaf.mismatched else 0.0


def _golden_header(leaf: LeafResult) -> str:
    where = f"output {leaf.path!r}: " if leaf.path else ""
    if leaf.problem is not None:
        return where + leaf.problem
    if leaf.nonfinite_mismatched:
        return (f"{where}NaN/Inf on one side only at {leaf.nonfinite_mismatched} element(s), first at index "
                f"{leaf.nonfinite_index} (target {leaf.actual_at_nonfinite}, reference {leaf.expected_at_nonfinite})")
    if isinstance(leaf, GoldenLeafResult) and leaf.gross and leaf.gross_values is not None:
        t, r, g = leaf.gross_values
        return (f"{where}{leaf.gross} element(s) beyond rounding by the {leaf.golden_dtype} golden, first at "
                f"index {leaf.gross_index}: target {t:.6g}, reference {r:.6g}, golden {g:.6g}; the target's "
                f"error there {abs(t - g):.3g} is over {leaf.policy.limits['max_rel']:g}x the reference's "
                f"({abs(r - g):.3g}) and over the reference's largest anywhere in the leaf "
                f"({max(leaf.reference.max_abs, leaf.floor.max_abs):.3g}), and the element is more than {GROSS_ERR_RATIO:g}x outside "
                "the allclose bound: the budget is for rounding, not for a wrong element")
    if isinstance(leaf, GoldenLeafResult) and leaf.golden_shape is not None:
        return (f"{where}outside the allclose floor ({leaf.mismatched} element(s) outside the bound, {leaf.allowed} "
                f"allowed, each within {GROSS_ERR_RATIO:g}x it; err/tol {leaf.err_ratio:.3g}), with no golden ratio to take: "
                f"the golden's shape {leaf.golden_shape} differs from the outputs' {tuple(leaf.shape)} (a value-dependent shape)")
    if isinstance(leaf, GoldenLeafResult) and not leaf.exact:
        parts = [f"{m} ratio {r:.3g} > {leaf.policy.limits[m]:g}"
                 + (" (the largest absolute error, held to the max_rel limit)" if m == "max_abs" else "")
                 for m, r in leaf.over_limit.items()]
        return (f"{where}target error vs the {leaf.golden_dtype} golden exceeds the reference's: "
                + ", ".join(parts))
    return f"{where}{leaf.mismatched} element(s) differ, compared exactly (an integer/bool leaf or amp.scale)"


_GOLDEN_COLUMNS = ("leaf", "golden", "rmse t/r (ratio)", "max_rel t/r (ratio)", "mean_rel t/r (ratio)",
                   "small t/r (ratio)", "max_abs t/r (ratio)", "verdict")


def format_golden_table(leaves: list[LeafResult]) -> list[str]:
    """Fixed-width table of golden metrics: target / reference error and their ratio per metric."""
    rows = [_GOLDEN_COLUMNS]
    for leaf in leaves:
        name = leaf.path or "<output>"
        verdict = "pass" if leaf.passed else "FAIL"
        if not isinstance(leaf, GoldenLeafResult) or leaf.exact or leaf.target is None:
            rows.append((name, "-", "-", "-", "-", "-", "-", leaf.problem or verdict))
            continue
        cells = []
        for metric in METRICS + JUDGED_EXTRA:
            if metric not in leaf.ratios:  # max_abs under msprobe's limit set: not measured
                cells.append("-")
                continue
            t, r = getattr(leaf.target, metric), getattr(leaf.reference, metric)
            cells.append(f"{t:.3g}/{r:.3g} ({leaf.ratios[metric]:.3g})")
        rows.append((name, leaf.golden_dtype or "-", *cells, verdict))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(_GOLDEN_COLUMNS))]
    return ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]


def _same_kind(a: torch.dtype, b: torch.dtype) -> bool:
    """Both real floating or both complex."""
    return (a.is_floating_point and b.is_floating_point) or (a.is_complex and b.is_complex)


def judge_golden_tensors(actual: torch.Tensor, expected: torch.Tensor, golden: torch.Tensor,
                         policy: GoldenPolicy, *, tolerance: Tolerance | None = None,
                         path: str = "", work_dtype: torch.dtype | None = None) -> GoldenLeafResult:
    """Judge one leaf: the target ``actual`` and the reference ``expected`` against ``golden``.

    Args:
        actual: the target's tensor (any device).
        expected: the reference's tensor; same shape and dtype as ``actual``.
        golden: the golden tensor (usually float64 or float32), same shape.
        policy: the ratio limits and small-value criterion.
        tolerance: allclose tolerance for the informative target-vs-reference metrics
            (default: ``policy.default_for_dtype`` of ``expected``).
        path: the leaf's name.
        work_dtype: the precision the recipe computes in (``WORK_DTYPES[recipe]``: bfloat16 for
            bf16 work), or None to judge by the leaf's own dtype. Under a 16-bit work dtype, when
            the golden is no finer than the leaf (an fp32 golden for an fp32 output, where no fp64
            golden could run), the rounding floor is the golden rounded to the work dtype: the
            reference can then equal the golden exactly, and a correct target with another kernel
            is only exact to the work dtype.

    Returns:
        A ``GoldenLeafResult`` (its ``passed`` is the verdict). A shape mismatch between target and
        reference, a dtype mismatch of another kind (float vs integer, real vs complex), or a golden
        of another shape fail with ``problem`` set; under the allclose floor (our limit set) a golden
        whose first dimension alone differs (a value-dependent shape) leaves the leaf to the floor
        (``golden_shape``). Two floating dtypes may differ (``note`` says
        so) under a 16-bit work dtype (or none given): the golden judges accuracy, and autocast's op
        lists differ between devices and kernels. Under fp32/fp64 work a dtype change is a failure
        (a target that returns bf16 where fp32 was computed lost precision). Integer and bool
        leaves, and under fp16 work the loss scaler's ``amp.scale`` (``_SCALER_STATE``), are judged exactly.
    """
    leaf, coarse = _prepare_leaf(actual, expected, golden, policy, tolerance, path, work_dtype)
    if coarse is None:
        return leaf
    if policy.msprobe:
        _judge_msprobe(leaf, actual, expected, golden)
        return leaf
    _judge_ratios(leaf, actual, expected, golden, coarse)
    _find_gross(leaf, actual, expected, golden, coarse)
    return leaf


def _may_hide_gross(leaf: GoldenLeafResult, actual: torch.Tensor) -> bool:
    """Whether ``leaf`` gets the gross-element test: our limit set with the allclose floor, the built-in
    budget taking every out-of-bound element, the worst more than ``GROSS_ERR_RATIO`` times outside the
    bound, a real floating leaf that is not a parameter after an optimizer step nor a gradient (module docstring).
    Cheap: the test itself runs only on such leaves."""
    policy = leaf.policy
    return (policy is not None and policy.allclose_floor and not policy.msprobe and leaf.problem is None
            and not leaf.exact and leaf.tolerance.rounding_budget and leaf.nonfinite_mismatched == 0
            and 0 < leaf.mismatched <= leaf.allowed and leaf.err_ratio > GROSS_ERR_RATIO
            and not actual.is_complex() and _STEP_PARAMETER_OR_GRADIENT.match(leaf.path) is None)


def _find_gross(leaf: GoldenLeafResult, actual: torch.Tensor, expected: torch.Tensor, golden: torch.Tensor,
                coarse: torch.dtype) -> None:
    """Set ``leaf.gross`` (and the first one's index and values): the elements more than
    ``GROSS_ERR_RATIO`` times outside ``atol + rtol·|e|`` where ``|a − g|`` exceeds the reference's
    largest error anywhere in the leaf (``reference.max_abs``, and the rounding floor's) and the
    ``max_rel`` limit times both ``|e − g|`` and ``|round(g) − g|`` there (the golden rounded to
    ``coarse``), taken in float64 over positions finite on all three. The reference's error at one
    element alone is a noisy yardstick: where its rounding happens to cancel the error both sides
    share, a more accurate target is 50× "worse" there (a residual stream kept in fp32 against one
    added after bf16 rounding). Only for leaves ``_may_hide_gross`` admits, after their ratios."""
    leaf.gross, leaf.gross_index, leaf.gross_values = 0, None, None
    if not _may_hide_gross(leaf, actual) or leaf.reference is None or leaf.floor is None:
        return
    tol, limit = leaf.tolerance, leaf.policy.limits["max_rel"]
    largest = max(leaf.reference.max_abs, leaf.floor.max_abs)
    if not math.isfinite(largest):
        return
    start = 0
    with _one_intra_op_thread():
        for a, e, g, rounded in float64_blocks(actual, expected, golden, golden.detach().to("cpu").to(coarse)):
            finite = torch.isfinite(a) & torch.isfinite(e) & torch.isfinite(g) & torch.isfinite(rounded)
            far = (a - e).abs() > GROSS_ERR_RATIO * (tol.atol + tol.rtol * e.abs())
            own = torch.maximum((e - g).abs(), (rounded - g).abs())
            error = (a - g).abs()
            gross = finite & far & (error > largest) & (error > limit * own)
            count = int(gross.sum())
            if count and leaf.gross == 0:
                i = int(torch.nonzero(gross)[0, 0])
                leaf.gross_index = _index(start + i, tuple(expected.shape))
                leaf.gross_values = (float(a[i]), float(e[i]), float(g[i]))
            leaf.gross += count
            start += a.numel()


def golden_shape_differs(golden_shape: tuple[int, ...], shape: tuple[int, ...]) -> str:
    """The sentence that names a golden of another shape than the outputs' (a leaf's ``problem``, or its
    ``note`` and ``checks.stored_golden``'s refusal where the floor judges it, ``golden_shape``)."""
    return f"golden shape {golden_shape} differs from the outputs' {shape}"


def _value_dependent(golden_shape: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """The golden's shape differs from the outputs' in its first dimension's length only, as where the
    values select the elements (``y[mask]``, ``masked_select``, ``nonzero``); any other difference (a
    transposed golden, another rank) is a structural problem."""
    return len(golden_shape) == len(shape) >= 1 and golden_shape[1:] == shape[1:] and golden_shape[0] != shape[0]


def _prepare_leaf(actual: torch.Tensor, expected: torch.Tensor, golden: torch.Tensor, policy: GoldenPolicy,
                  tolerance: Tolerance | None, path: str,
                  work_dtype: torch.dtype | None) -> tuple[GoldenLeafResult, torch.dtype | None]:
    """``judge_golden_tensors`` up to the golden metrics: ``(leaf, coarse)`` with the informative
    target-vs-reference metrics, the structural checks and the dtype the rounding floor is taken in;
    ``coarse`` None when the leaf is already judged (a structural problem, an integer/bool leaf or the loss
    scaler's scale, ``_SCALER_STATE``)."""
    tol = tolerance if tolerance is not None else default_for_dtype(expected.dtype)
    exact = (not (expected.dtype.is_floating_point or expected.dtype.is_complex)
             or (path == _SCALER_STATE and work_dtype == torch.float16))
    lenient = work_dtype is None or (work_dtype.is_floating_point and torch.finfo(work_dtype).bits <= 16)
    base, coarse, note = _target_vs_reference(actual, expected, tol, exact, lenient, path)
    leaf = GoldenLeafResult(**{f.name: getattr(base, f.name) for f in dataclasses.fields(LeafResult)})
    leaf.policy = policy
    leaf.exact = exact
    leaf.note = note
    leaf.golden_dtype = str(golden.dtype).removeprefix("torch.")
    if leaf.problem is not None or exact:
        return leaf, None
    if tuple(golden.shape) != tuple(expected.shape):
        shapes = golden_shape_differs(tuple(golden.shape), tuple(expected.shape))
        if policy.allclose_floor and not policy.msprobe and _value_dependent(tuple(golden.shape), tuple(expected.shape)):
            # a shape that depends on values (``y[y > t]``, ``nonzero``): the golden selected other elements, the
            # two sides the same ones; no ratio can be taken, so the floor alone decides (``passed``)
            leaf.golden_shape = tuple(golden.shape)
            leaf.note = "; ".join(filter(None, [note, f"{shapes} (a value-dependent shape): judged by the allclose "
                                                      "floor alone"]))
        else:
            leaf.problem = shapes
        return leaf, None
    if (lenient and work_dtype is not None and coarse.is_floating_point and golden.is_floating_point()
            and torch.finfo(golden.dtype).bits <= torch.finfo(coarse).bits
            and torch.finfo(work_dtype).eps > torch.finfo(coarse).eps):
        coarse = work_dtype  # a golden no finer than the output: see judge_golden_tensors' work_dtype
    return leaf, coarse


def _target_vs_reference(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance, exact: bool, lenient: bool,
                         path: str) -> tuple[LeafResult, torch.dtype, str | None]:
    """``(base, coarse, note)`` of ``judge_golden_tensors``: the informative target-vs-reference
    comparison (``compare_tensors``, exact for integer and bool leaves), the dtype its rounding floor
    is taken in, and the note of two floating dtypes that differ where that is ``lenient``."""
    if actual.dtype != expected.dtype and _same_kind(actual.dtype, expected.dtype) and not exact and lenient:
        # Autocast op lists differ between devices and kernels (measured: under CPU bf16 autocast
        # nn.TransformerEncoder's fast path returns bf16, its slow path fp32): the golden judges
        # accuracy, not the dtype. Informative metrics are taken in the finer dtype, the rounding
        # floor in the coarser one.
        common = torch.promote_types(actual.dtype, expected.dtype)
        coarse = actual.dtype if common == expected.dtype else expected.dtype
        base = compare_tensors(actual.to(common), expected.to(common), tol, path)
        base.dtype = str(actual.dtype).removeprefix("torch.")
        base.expected_dtype = str(expected.dtype).removeprefix("torch.")
        note = f"dtype differs: target {base.dtype}, reference {base.expected_dtype} (judged against the golden)"
        return base, coarse, note
    return compare_tensors(actual, expected, EXACT if exact else tol, path), expected.dtype, None


def _judge_ratios(leaf: GoldenLeafResult, actual: torch.Tensor, expected: torch.Tensor, golden: torch.Tensor,
                  coarse: torch.dtype) -> None:
    """Set ``leaf``'s ``target``, ``reference`` and ``floor`` metrics against ``golden`` (the floor: the
    golden rounded to ``coarse``) and their ``ratios``, under ``leaf.policy``'s small-value criterion."""
    threshold, small_atol = leaf.policy.small_values_for(coarse)
    sides = (_SideSums(), _SideSums(), _SideSums())  # target, reference, golden rounded to the dtype
    with _one_intra_op_thread():
        for a, e, g, rounded in float64_blocks(actual, expected, golden, golden.detach().to("cpu").to(coarse)):
            mask = torch.isfinite(a) & torch.isfinite(e) & torch.isfinite(g)
            small = mask & (g.abs() < threshold)
            mask_floor = mask & torch.isfinite(rounded)  # a golden beyond the dtype's range rounds to inf
            sides[0].add(a, g, mask, small, small_atol)
            sides[1].add(e, g, mask, small, small_atol)
            sides[2].add(rounded, g, mask_floor, small & mask_floor, small_atol)
    _set_ratios(leaf, *sides)


def _set_ratios(leaf: GoldenLeafResult, target: _SideSums, reference: _SideSums, floor: _SideSums) -> None:
    """``leaf``'s ``target``, ``reference`` and ``floor`` metrics from their sums, and their ``ratios``."""
    leaf.target, leaf.reference, leaf.floor = target.result(), reference.result(), floor.result()
    share_floor = 1.0 / leaf.reference.small if leaf.reference.small else 0.0
    leaf.ratios = {
        "rmse": ratio(leaf.target.rmse, leaf.reference.rmse, leaf.floor.rmse),
        "max_rel": ratio(leaf.target.max_rel, leaf.reference.max_rel, leaf.floor.max_rel),
        "mean_rel": ratio(leaf.target.mean_rel, leaf.reference.mean_rel, leaf.floor.mean_rel),
        "small_share": ratio(leaf.target.small_share, leaf.reference.small_share,
                             max(share_floor, leaf.floor.small_share)),
        "max_abs": ratio(leaf.target.max_abs, leaf.reference.max_abs, leaf.floor.max_abs),
    }


#: A floating leaf of at most this many elements is judged with the other small leaves of its output
#: (``_judge_ratios_together``). Judged alone, a leaf costs about a hundred small tensor operations
#: whatever its size: the tiny Aurora model's training step has 505 leaves, most of them a few hundred
#: elements, and their golden verdict took 0.2 s one by one.
SMALL_LEAF = 16 * 1024


_Item = tuple[GoldenLeafResult, torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype]


def _judge_ratios_together(items: list[_Item]) -> None:
    """``_judge_ratios`` of several small leaves, items ``(leaf, actual, expected, golden, coarse)``: the
    leaves of one ``coarse`` dtype laid end to end in batches of about ``WORKER_BLOCK`` elements, each
    side's sums taken per leaf in one pass (``golden_metrics.segment_sums``). The same elements and
    counts as leaf by leaf; the float64 sums may differ in their last bits (another summation order)."""
    groups: dict[torch.dtype, list[_Item]] = {}
    for item in items:
        groups.setdefault(item[4], []).append(item)
    with _one_intra_op_thread():
        for coarse, group in groups.items():
            batch: list[_Item] = []
            size = 0
            for item in group:
                batch.append(item)
                size += item[2].numel()
                if size >= WORKER_BLOCK:
                    _judge_batch(batch, coarse)
                    batch, size = [], 0
            if batch:
                _judge_batch(batch, coarse)


def _judge_batch(batch: list[_Item], coarse: torch.dtype) -> None:
    """One batch of ``_judge_ratios_together`` (all leaves judged by the same policy)."""
    threshold, small_atol = batch[0][0].policy.small_values_for(coarse)
    columns: tuple[list[torch.Tensor], ...] = ([], [], [], [])  # target, reference, golden, golden rounded
    sizes, leaves = [], []
    for leaf, actual, expected, golden, _ in batch:
        flats = [flat_real_cpu(t) for t in (actual, expected, golden, golden.detach().to("cpu").to(coarse))]
        if len({f.numel() for f in flats}) != 1:  # e.g. a real golden of a complex output: judged alone,
            _judge_ratios(leaf, actual, expected, golden, coarse)  # which raises float64_blocks' error
            continue
        for column, flat in zip(columns, flats):
            column.append(flat.to(torch.float64))
        sizes.append(flats[0].numel())
        leaves.append(leaf)
    if not leaves:
        return
    a, e, g, rounded = (torch.cat(column) for column in columns)
    segment = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    mask = torch.isfinite(a) & torch.isfinite(e) & torch.isfinite(g)
    small = mask & (g.abs() < threshold)
    mask_floor = mask & torch.isfinite(rounded)  # a golden beyond the dtype's range rounds to inf
    target = segment_sums(a, g, mask, small, small_atol, segment, len(sizes))
    reference = segment_sums(e, g, mask, small, small_atol, segment, len(sizes))
    floor = segment_sums(rounded, g, mask_floor, small & mask_floor, small_atol, segment, len(sizes))
    for leaf, t, r, f in zip(leaves, target, reference, floor):
        _set_ratios(leaf, t, r, f)


@contextlib.contextmanager
def _one_intra_op_thread() -> Iterator[None]:
    """Torch ops of the block loops on one intra-op thread (restored on exit). Each block
    (``compare.WORKER_BLOCK`` elements) is a few dozen small elementwise ops and masked copies; with
    two threads each op opens an OpenMP parallel region, which on a loaded machine costs more than
    the op: judging a 2 M-element fp32 leaf took 11.8 s with 2 threads and 0.23 s with one (2-core
    machine, load average 6–8), 11 M elements 75 s before this (a resnet18 training step judges
    three such sets of leaves)."""
    before = torch.get_num_threads()
    if before > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if before > 1:
            torch.set_num_threads(before)


def _real_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.empty(0, dtype=dtype).real.dtype if dtype.is_complex else dtype


def _judge_msprobe(leaf: GoldenLeafResult, actual: torch.Tensor, expected: torch.Tensor, golden: torch.Tensor) -> None:
    """msprobe 26.2.0's benchmark metrics of both sides and their ratios into ``leaf`` (see ``_MsprobeSums``)."""
    golden_dtype = _real_dtype(golden.dtype)
    target = _MsprobeSums(_real_dtype(actual.dtype), golden_dtype)
    reference = _MsprobeSums(_real_dtype(expected.dtype), golden_dtype)
    with _one_intra_op_thread():
        for a, e, g in float64_blocks(actual, expected, golden):
            target.add(a, g)
            reference.add(e, g)
    leaf.target, leaf.reference = target.result(), reference.result()
    dtype = target.dtype  # the floor is chosen by the NPU (target) row's dtype
    leaf.ratios = {m: msprobe_ratio(getattr(leaf.target, m), getattr(leaf.reference, m), dtype) for m in METRICS}
    if dtype == torch.float64:
        leaf.note = ((leaf.note + "; ") if leaf.note else "") + "msprobe skips float64; judged with its fp32 values"


def judge_golden(actual: Any, expected: Any, golden: Any, policy: GoldenPolicy = DEFAULT_GOLDEN, *,
                 tolerance: Tolerance | None = None, name: str = "",
                 work_dtype: torch.dtype | None = None) -> GoldenCompareResult:
    """Judge nested outputs under the golden policy, leaf by leaf.

    Args:
        actual: the target's output (tensors or nested tuples/lists/dicts/ModelOutputs of them).
        expected: the reference's output, same structure.
        golden: the golden output, same structure (float leaves in the golden dtype).
        policy: the ratio limits (see ``GoldenPolicy``; ``default_golden_for_recipe`` for a recipe's).
        tolerance: allclose tolerance for the informative metrics (default: by dtype).
        name: the check's name, for messages.
        work_dtype: the recipe's work dtype (``WORK_DTYPES``), see ``judge_golden_tensors``.

    Returns:
        A ``GoldenCompareResult``: passed when every leaf passes. A leaf missing on either side, a
        ``None`` against a tensor, or a leaf without a golden counterpart fails with ``problem``.
        Each leaf's result is ``judge_golden_tensors``'; floating leaves of at most ``SMALL_LEAF``
        elements have their golden metrics taken together (``_judge_ratios_together``), whose float64
        sums may differ from a leaf-by-leaf pass in their last bits.

    Raises:
        TypeError, ValueError: as ``compare.compare`` for structures it cannot walk.
    """
    result = GoldenCompareResult(name=name, policy=policy)
    got, want = _leaves_by_path(actual, "actual"), _leaves_by_path(expected, "expected")
    gold = _leaves_by_path(golden, "golden")
    small: list[_Item] = []  # floating leaves of at most SMALL_LEAF elements, judged together at the end
    for path in list(want) + [p for p in got if p not in want]:
        a, e, g = got.get(path), want.get(path), gold.get(path)
        tol = tolerance or default_for_dtype(e.dtype if e is not None else torch.float32)
        problem = None
        if path not in got:
            problem = "missing in actual output"
        elif path not in want:
            problem = "not in expected output"
        elif a is None or e is None:
            if a is e:
                continue
            problem = f"{'actual' if a is None else 'expected'} is None, the other is a tensor"
        elif path not in gold or (g is None and (e.dtype.is_floating_point or e.dtype.is_complex)):
            problem = "the golden run has no such output"
        if problem is not None:
            result.leaves.append(GoldenLeafResult(path=path, tolerance=tol, problem=problem, policy=policy))
            continue
        if g is None:  # integer leaf without golden: exact comparison needs none
            g = e
        leaf, coarse = _prepare_leaf(a, e, g, policy, tol, path, work_dtype)
        result.leaves.append(leaf)
        if coarse is None:
            continue
        if policy.msprobe:
            _judge_msprobe(leaf, a, e, g)
        elif e.numel() <= SMALL_LEAF:
            small.append((leaf, a, e, g, coarse))
        else:
            _judge_ratios(leaf, a, e, g, coarse)
            _find_gross(leaf, a, e, g, coarse)
    if small:
        _judge_ratios_together(small)
        for item in small:
            _find_gross(*item)
    return result

