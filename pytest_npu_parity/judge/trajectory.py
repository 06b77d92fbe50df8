"""Two training trajectories, one verdict: do the loss and gradient-norm curves of N steps agree?

A port is accepted or rejected by its loss curve. This judge takes two trajectories as named curves,
each a 1-D tensor with one value per optimizer step:

* ``loss`` — the training loss of each step (required);
* ``grad_norm`` — the global gradient 2-norm before clipping (optional);
* ``layer_grad_norm.<module>`` — one module's gradient 2-norm per step (optional, any number).

Per step it computes the relative error ``|a - e| / |e|`` (``e`` the reference's value; a zero
reference value counts as ``tiny`` of the dtype, float64). The verdict is msprobe's: the **mean
relative loss error** over all steps against a limit (msprobe's training-debug guide calls a port
misaligned above 1 %). Reported besides: the first step where the loss curves part, the first step
where the grad-norm curves part, and the module whose gradient-norm curve parts first (the
Ascend/pytorch#107 pattern: loss within 1 %, the first layer's gradients 50 % off). "Part" means the
relative error averaged over a trailing window of ``PARTING_WINDOW`` steps exceeds the limit: a single
noisy step does not part two curves, a fault that starts at step 0 parts them at step 0.

The learning-rate curve ``lr`` is judged at the loss limit, and the curves recorded at checkpoints
(``weight_norm.<module>``, ``buffer_norm.<module>``: e.g. BatchNorm running statistics, which the
training loss does not depend on) at the per-module limit. A reference loss that is not finite (a
diverged run) is a problem: two diverged runs agree on nothing.

The global gradient-norm curve fails the verdict too when its mean relative error exceeds
``grad_norm_limit`` (a gradient fault the loss does not yet show), and each module's gradient-norm
curve when its mean relative error exceeds ``layer_limit``. A module's curve varies legitimately far
more than the global one (a module with small gradients has a large relative error): on the tiny
Aurora on another CPU kernel path (ATen default + AVX2) against the committed baseline, 60 fp32 steps
gave per-module mean relative errors up to 1.1e-5 (the text encoder's cross attention; largest single
step 5.8e-4) while the global grad norm stayed at 3.8e-7; 300 steps up to 3.0e-5 (fp32) and 3.5e-2
(bf16). So ``layer_limit`` is its own: 1e-3 for fp32 and 0.25 for bf16, about 33× and 7× above those.

Default limits per recipe (``DEFAULT_LIMITS``), measured on the seeded tiny Aurora, 300 AdamW steps
(upstream's lr 1e-4, betas (0.9, 0.95), eps 1e-8, weight decay 0.1, clip 1.0) of 4 real CO2 windows
each, shared random stream, 2-core AMD EPYC, torch 2.14.1, against the same run with 2 threads:

============================  =================  ======================
variant                        mean rel. loss    mean rel. grad norm
============================  =================  ======================
fp32, 1 thread                 7.2e-8             3.7e-7
fp32, ATen default + AVX2      1.1e-7             6.8e-7
fp32, weight × (1 + 1e-4)      1.5e-6 (fault)     9.1e-6
fp32, AdamW eps × 10           1.5e-4 (fault)     1.3e-4
fp32, no gradient clipping     2.5e-2 (fault)     2.6e-2
bf16, 1 thread                 1.1e-3             7.4e-3
bf16, ATen default + AVX2      1.6e-3             1.1e-2
bf16, weight × (1 + 1e-4)      1.2e-3 (not seen)  8.1e-3
============================  =================  ======================

The suite's short form, 60 steps (``parity_suites/aurora/test_trajectory.py``), against the committed
baseline: fp32 on ATen default + AVX2 1e-7 loss (5.5e-8) and 3.8e-7 grad norm; the weight fault
8.0e-7 loss and 6.1e-6 grad norm, AdamW eps × 10 2.5e-5 and 1.2e-5, no clipping 1.9e-3 and 6.5e-3.

fp32 trajectories of this length are not chaotic here: legitimate variation stays near 1e-7, so the
fp32 limits (1e-6 loss; 2.5e-6 grad norm, ~3.7× above the largest legitimate 6.8e-7 and ~2.4× below
the weight fault's 6.1e-6 at 60 steps) separate the two; a weight fault shows in the grad norm first. bf16
rounding differs with the reduction order (threads, kernels): the bf16 limits are msprobe's 1 % for
the loss (6× above the legitimate 1.6e-3) and 5 % for the grad norm; a 1e-4 weight fault is below
what a bf16 trajectory can tell and is left to the fp32 recipe.

fp16 (autocast fp16 with a dynamic loss scaler; 60 steps against its committed baseline) varies about ten
times less than bf16 (three more mantissa bits): 1.0e-4 loss, 9.2e-4 grad norm, 4.0e-3 largest module mean
(ATen default + AVX2; torch 2.5.1 9.3e-5; 1 thread 7.2e-5), while missing clipping moves the loss by 2.0e-3,
which bf16's 1 % would pass. Its limits: loss 5e-4, grad norm 5e-3 (5× above), each module 4e-2, forecasts
1e-3 (60× above the measured 1.7e-5: the 300-step growth is not measured for fp16; bf16's grew 37×).
All rows: ``benchmarks/results/calibration_trajectory.md``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from .forecast import PREFIX as FORECAST_PREFIX
from .forecast import ForecastResult, judge_forecast

#: Steps the parting test averages over (see the module docstring).
PARTING_WINDOW = 10

#: Curve names (see the module docstring).
LOSS, GRAD_NORM, LR, LAYER_PREFIX = "loss", "grad_norm", "lr", "layer_grad_norm."
#: Curves recorded at checkpoints (``checkpoint_steps``), not every step.
CHECKPOINT_PREFIXES = ("weight_norm.", "buffer_norm.")


@dataclass(frozen=True)
class TrajectoryPolicy:
    """Limits of a trajectory verdict.

    Attributes:
        loss_limit: largest mean relative loss error that passes (unitless).
        grad_norm_limit: largest mean relative error of the global grad-norm curve that passes;
            None: reported, never failed.
        layer_limit: largest mean relative error of each module's grad-norm curve that passes (the
            parting test of those curves uses it too); None: reported, never failed, and parting
            judged at ``grad_norm_limit`` (else ``loss_limit``).
        forecast_limit: largest relative difference of each forecast metric (``judge.forecast``:
            MSE, MAE, CRPS of the trained model on held-out windows) that passes; None: reported only.
        window: steps of the trailing window of the parting test (``PARTING_WINDOW``).
        reason: where the limits come from (shown in the message).
    """

    loss_limit: float
    grad_norm_limit: float | None = None
    layer_limit: float | None = None
    forecast_limit: float | None = None
    window: int = PARTING_WINDOW
    reason: str = ""

    def __post_init__(self) -> None:
        limits = (self.grad_norm_limit, self.layer_limit, self.forecast_limit)
        if not (self.loss_limit > 0) or any(x is not None and not x > 0 for x in limits):
            raise ValueError(f"TrajectoryPolicy: limits must be > 0, got loss_limit={self.loss_limit!r}, "
                             f"grad_norm_limit={self.grad_norm_limit!r}, layer_limit={self.layer_limit!r}, "
                             f"forecast_limit={self.forecast_limit!r}")
        if not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"TrajectoryPolicy: window must be a positive int, got {self.window!r}")


#: Default limits per recipe (measured, module docstring); other recipes use ``bf16``'s. The forecast
#: limits (``judge.forecast``: MSE, MAE, CRPS of 16 samples on 8 held-out El Nino windows after the
#: trajectory): legitimate variation (ATen default + AVX2, torch 2.5.1, against the committed baseline)
#: reached 1.1e-5 (fp32) and 7.5e-3 (bf16) after 300 steps, 4.1e-7 and 7.2e-5 after 60; fp32 1e-4 and
#: bf16 5e-2 sit 9× and 6.7× above. After 60 fp32 steps, missing clipping moves the forecast metrics by
#: 2.6e-4, dropout 0.1 for 0.2 by 1.0e-3, the WarmupLR one step ahead by 1.4e-4 (failing this limit
#: too); AdamW eps × 10 by 5.9e-5 and a 1e-4 weight fault by 3.8e-7 (the curves fail those).
DEFAULT_LIMITS = {
    "fp32": TrajectoryPolicy(1e-6, 2.5e-6, 1e-3, 1e-4, reason="fp32: legitimate variation <= 1.1e-7 loss, 6.8e-7 grad "
                                                      "norm over 300 tiny-Aurora steps (measured)"),
    "bf16": TrajectoryPolicy(1e-2, 5e-2, 0.25, 5e-2, reason="bf16: msprobe's 1 % loss line; legitimate variation <= "
                                                 "1.6e-3 loss, 1.1e-2 grad norm over 300 tiny-Aurora steps "
                                                 "(measured)"),
    "fp16": TrajectoryPolicy(5e-4, 5e-3, 4e-2, 1e-3, reason="fp16: legitimate variation <= 1.0e-4 loss, 9.2e-4 grad "
                                                      "norm over 60 tiny-Aurora steps (measured); no clipping moves "
                                                      "the loss by 2.0e-3"),
}


def default_policy(recipe: str) -> TrajectoryPolicy:
    """``DEFAULT_LIMITS[recipe]``, ``bf16``'s for a recipe without its own (bf16-weights)."""
    return DEFAULT_LIMITS.get(recipe, DEFAULT_LIMITS["bf16"])


def relative_errors(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """``|actual - expected| / max(|expected|, tiny)`` per step, float64 ``[N]``. A step that is not
    finite on both sides alike (both NaN, or the same infinity: a step a loss scaler skipped for
    overflow on both) has error 0; a step finite on one side only has error inf.

    Raises:
        ValueError: the curves are not 1-D of the same length.
    """
    a = torch.as_tensor(actual).detach().to("cpu", torch.float64).reshape(-1)
    e = torch.as_tensor(expected).detach().to("cpu", torch.float64).reshape(-1)
    if a.shape != e.shape or a.numel() == 0:
        raise ValueError(f"curves of {a.numel()} and {e.numel()} steps cannot be compared step by step")
    errors = (a - e).abs() / e.abs().clamp_min(torch.finfo(torch.float64).tiny)
    finite = torch.isfinite(a) & torch.isfinite(e)
    alike = (torch.isnan(a) & torch.isnan(e)) | (torch.isinf(a) & (a == e))
    return torch.where(finite, errors, torch.where(alike, torch.zeros_like(errors), torch.full_like(errors, math.inf)))


def parting_step(errors: torch.Tensor, limit: float, window: int = PARTING_WINDOW) -> int | None:
    """The first step (0-based) whose relative error, averaged over it and up to ``window - 1`` steps
    before it, exceeds ``limit``; None when there is none."""
    csum = torch.cat([torch.zeros(1, dtype=torch.float64), errors.cumsum(0)])
    steps = torch.arange(errors.numel())
    start = (steps - window + 1).clamp_min(0)
    means = (csum[steps + 1] - csum[start]) / (steps + 1 - start)
    over = torch.nonzero(means > limit)
    return int(over[0]) if over.numel() else None


@dataclass
class CurveResult:
    """One curve judged: ``name``, ``steps``, ``mean_rel`` (mean relative error), ``max_rel`` and the
    step of it, ``parted_at`` (``parting_step`` at ``limit``), ``limit`` (None: reported only)."""

    name: str
    steps: int
    mean_rel: float
    max_rel: float
    max_step: int
    parted_at: int | None
    limit: float | None

    @property
    def passed(self) -> bool:
        return self.limit is None or self.mean_rel <= self.limit

    def to_row(self) -> dict[str, Any]:
        """The curve as a report row (the report's row schema: ``leaf`` the curve, ``numel`` its steps,
        ``max_rel`` its largest relative error, ``err_ratio`` mean relative error / limit; plus
        ``traj_mean_rel``, ``traj_limit``, ``traj_parted_at`` and ``traj_max_step``)."""
        return {"leaf": self.name, "shape": str(self.steps), "dtype": None, "numel": self.steps,
                "max_abs": math.nan, "max_rel": self.max_rel, "rel_l2": math.nan, "cosine": math.nan,
                "err_ratio": self.mean_rel / self.limit if self.limit else math.nan,
                "mismatched": None, "mismatched_frac": None, "nonfinite_mismatched": None,
                "rtol": None, "atol": None, "budget": None, "tolerance_source": "trajectory",
                "tolerance_reason": None, "problem": None, "traj_mean_rel": self.mean_rel,
                "traj_limit": self.limit, "traj_parted_at": self.parted_at, "traj_max_step": self.max_step,
                "verdict": "pass" if self.passed else "fail"}


@dataclass
class TrajectoryResult:
    """The verdict of ``judge_trajectory``.

    Attributes:
        curves: every curve judged, ``loss`` first.
        policy: the limits applied.
        problems: curves that could not be compared (missing on one side, other length, NaN).
        series: ``{curve: (target values, reference values)}`` of the ``loss`` and ``grad_norm``
            curves (float lists, one value per step), for the report's plots.
        forecast: the forecast verdict of the trained models (``judge.forecast.ForecastResult``),
            or None when the trajectory evaluated none.
    """

    curves: list[CurveResult]
    policy: TrajectoryPolicy
    problems: list[str] = field(default_factory=list)
    series: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)
    forecast: ForecastResult | None = None

    @property
    def leaves(self) -> list[Any]:
        """The judged curves, then the forecast metrics (the report's rows, as ``CompareResult.leaves``)."""
        return self.curves + (self.forecast.metrics if self.forecast is not None else [])

    def _curve(self, name: str) -> CurveResult | None:
        return next((c for c in self.curves if c.name == name), None)

    @property
    def mean_rel_loss_error(self) -> float:
        """Mean relative loss error over all steps (NaN without a loss curve)."""
        loss = self._curve(LOSS)
        return loss.mean_rel if loss is not None else math.nan

    @property
    def loss_parted_at(self) -> int | None:
        """First step where the loss curves part (``parting_step``), or None."""
        loss = self._curve(LOSS)
        return loss.parted_at if loss is not None else None

    @property
    def grad_norm_parted_at(self) -> int | None:
        """First step where the global grad-norm curves part, or None (also without that curve)."""
        curve = self._curve(GRAD_NORM)
        return curve.parted_at if curve is not None else None

    @property
    def first_parting_layer(self) -> tuple[str, int] | None:
        """``(module, step)`` of the module grad-norm curve that parts first (ties: the larger mean
        error), or None."""
        parted = [c for c in self.curves if c.name.startswith(LAYER_PREFIX) and c.parted_at is not None]
        if not parted:
            return None
        first = min(parted, key=lambda c: (c.parted_at, -c.mean_rel))
        return first.name[len(LAYER_PREFIX):], int(first.parted_at)

    @property
    def passed(self) -> bool:
        return (not self.problems and all(c.passed for c in self.curves)
                and (self.forecast is None or self.forecast.passed))

    def __bool__(self) -> bool:
        return self.passed

    def format(self, context: str = "") -> str:
        """The verdict as text: the four findings, then one line per failing curve."""
        def step(s: int | None) -> str:
            return "none" if s is None else f"step {s}"

        layer = self.first_parting_layer
        head = "Trajectories agree" if self.passed else "Trajectories part"
        loss = self._curve(LOSS)
        lines = [f"{head}{f' ({context})' if context else ''}",
                 f"mean relative loss error {self.mean_rel_loss_error:.3g} (limit {self.policy.loss_limit:g}) "
                 f"over {loss.steps} steps" if loss is not None else "the loss curves could not be compared (below)",
                 f"loss curves part at: {step(self.loss_parted_at)}; grad-norm curves part at: "
                 f"{step(self.grad_norm_parted_at)}; first module whose gradient norm parts: "
                 f"{'none' if layer is None else f'{layer[0]} at step {layer[1]}'}"]
        lines += [f"  {c.name}: mean relative error {c.mean_rel:.3g} > {c.limit:g} (largest {c.max_rel:.3g} at "
                  f"step {c.max_step})" for c in self.curves if not c.passed]
        lines += [f"  {p}" for p in self.problems]
        if self.forecast is not None:
            lines.append(self.forecast.format())
        if self.policy.reason:
            lines.append(f"(limits: {self.policy.reason})")
        return "\n".join(lines)


def judge_trajectory(actual: Mapping[str, Any], expected: Mapping[str, Any],
                     policy: TrajectoryPolicy, window_labels: Sequence[str] | None = None) -> TrajectoryResult:
    """Judge the target's curves ``actual`` against the reference's ``expected`` (module docstring).

    Args:
        actual, expected: curve name -> 1-D tensor ``[N]`` (any floating dtype; one value per step).
            ``loss`` is required on both; other names are judged where both sides have them.
        policy: the limits.
        window_labels: labels of the held-out windows (``judge.forecast.judge_forecast``).

    Returns:
        A ``TrajectoryResult``: passes when the mean relative loss error is within
        ``policy.loss_limit``, the global grad-norm curve's within ``policy.grad_norm_limit``, each
        module's within ``policy.layer_limit``, and no curve
        had a problem.

    Raises:
        ValueError: no ``loss`` curve on one of the sides.
    """
    for side, curves in (("target", actual), ("reference", expected)):
        if LOSS not in curves:
            raise ValueError(f"judge_trajectory: the {side} has no {LOSS!r} curve (names: {sorted(curves)})")
    names = [LOSS] + sorted(n for n in expected if n != LOSS and (
        n in (GRAD_NORM, LR) or n.startswith(LAYER_PREFIX) or n.startswith(CHECKPOINT_PREFIXES)))
    curves, problems, series = [], [], {}
    reference_loss = torch.as_tensor(expected[LOSS]).detach().to("cpu", torch.float64).reshape(-1)
    if not torch.isfinite(reference_loss).all():
        step = int(torch.nonzero(~torch.isfinite(reference_loss))[0])
        problems.append(f"loss: the reference's loss is not finite from step {step} on (the run diverged): two "
                        "diverged runs agree on nothing, so the curves cannot tell a fault")
    marks = expected.get("checkpoint_steps")
    marks = torch.as_tensor(marks).reshape(-1).tolist() if marks is not None else None
    for name in names:
        if name not in actual:
            problems.append(f"{name}: recorded by the reference, missing on the target")
            continue
        limit = {LOSS: policy.loss_limit, LR: policy.loss_limit, GRAD_NORM: policy.grad_norm_limit}.get(
            name, policy.layer_limit)
        parting_limit = next(x for x in (limit, policy.grad_norm_limit, policy.loss_limit) if x is not None)
        try:
            errors = relative_errors(actual[name], expected[name])
        except ValueError as exc:
            problems.append(f"{name}: {exc}")
            continue
        if name in (LOSS, GRAD_NORM):
            series[name] = (_values(actual[name]), _values(expected[name]))
        top, parted = int(errors.argmax()), parting_step(errors, parting_limit, policy.window)
        largest = float(errors[top])
        if name.startswith(CHECKPOINT_PREFIXES) and marks is not None and len(marks) == errors.numel():
            top, parted = marks[top], None if parted is None else marks[parted]  # steps, not checkpoint indices
        curves.append(CurveResult(name, errors.numel(), float(errors.mean()), largest, top, parted, limit))
    forecast = (judge_forecast(actual, expected, policy.forecast_limit, window_labels)
                if any(name.startswith(FORECAST_PREFIX) for name in expected) else None)
    return TrajectoryResult(curves, policy, problems, series, forecast)


def _values(curve: Any) -> list[float]:
    return torch.as_tensor(curve).detach().to("cpu", torch.float64).reshape(-1).tolist()
