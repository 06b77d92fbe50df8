"""Forecast quality on each side, one verdict: do the two sides forecast equally well?

A port is also judged by its task metric. For a probabilistic forecaster this module computes, per
held-out window, three metrics of ``S`` sampled forecasts ``x`` against the observed continuation
``y`` (horizon ``H``):

* ``mse`` — mean over the horizon of ``(mean_s x − y)²`` (the sample mean as the point forecast);
* ``mae`` — mean over the horizon of ``|median_s x − y|`` (the sample median);
* ``crps`` — the continuous ranked probability score of the sample set, averaged over the horizon,
  in its energy form ``E|X − y| − ½ E|X − X'|`` (Gneiting & Raftery 2007, eq. 21), with the
  unbiased pair term ``1 / (S (S − 1))`` over ``s ≠ s'`` (the "fair" CRPS, Ferro 2014), so it is
  exact for ``S`` i.i.d. samples; lower is better, 0 for a perfect point mass.

``judge_forecast`` compares each metric, averaged over the windows, between the target and the
reference: relative difference ``|m_t − m_r| / |m_r|`` against a limit, and lists the windows whose
CRPS (else the first metric both sides have) differs most (where to drill down).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

#: The metrics, in report order.
METRICS = ("mse", "mae", "crps")
#: Leaf prefix of per-window metric tensors in a trajectory's leaves.
PREFIX = "forecast."
#: Windows listed as the most differing.
TOP_WINDOWS = 3


def forecast_metrics(samples: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-window ``mse``, ``mae`` and ``crps`` (module docstring) of sampled forecasts.

    Args:
        samples: ``[W, S, H]`` forecasts (W windows, S samples each, horizon H), any floating dtype.
        target: ``[W, H]`` observed continuations.

    Returns:
        ``{metric: float32 [W]}`` on ``samples``' device, computed in float32.

    Raises:
        ValueError: shapes that do not match ``[W, S, H]`` / ``[W, H]``, or fewer than 2 samples.
    """
    if samples.dim() != 3 or target.shape != (samples.shape[0], samples.shape[2]):
        raise ValueError(f"forecast_metrics: samples must be [W, S, H] and target [W, H], got "
                         f"{tuple(samples.shape)} and {tuple(target.shape)}")
    s = samples.shape[1]
    if s < 2:
        raise ValueError("forecast_metrics: the CRPS needs at least 2 samples per window")
    x, y = samples.float(), target.float().unsqueeze(1)
    mse = (x.mean(1) - y[:, 0]).square().mean(-1)
    mae = (x.median(1).values - y[:, 0]).abs().mean(-1)
    spread = (x.unsqueeze(1) - x.unsqueeze(2)).abs().sum((1, 2)) / (s * (s - 1))  # [W, H]
    crps = ((x - y).abs().mean(1) - 0.5 * spread).mean(-1)
    return {"mse": mse, "mae": mae, "crps": crps}


@dataclass
class MetricResult:
    """One metric on both sides: ``target`` and ``reference`` (means over the windows), ``rel_diff``
    ``|target − reference| / |reference|``, ``limit`` (None: reported only)."""

    name: str
    target: float
    reference: float
    rel_diff: float
    limit: float | None

    @property
    def passed(self) -> bool:
        return self.limit is None or self.rel_diff <= self.limit

    def to_row(self) -> dict[str, Any]:
        """The metric as a report row (``leaf`` ``forecast.<metric>``, ``max_rel`` its relative
        difference, ``err_ratio`` relative difference / limit)."""
        return {"leaf": PREFIX + self.name, "shape": None, "dtype": None, "numel": None,
                "max_abs": abs(self.target - self.reference), "max_rel": self.rel_diff, "rel_l2": math.nan,
                "cosine": math.nan, "err_ratio": self.rel_diff / self.limit if self.limit else math.nan,
                "mismatched": None, "mismatched_frac": None, "nonfinite_mismatched": None, "rtol": None,
                "atol": None, "budget": None, "tolerance_source": "forecast", "tolerance_reason": None,
                "problem": None, "traj_mean_rel": self.rel_diff, "traj_limit": self.limit,
                "traj_parted_at": None, "traj_max_step": None, "verdict": "pass" if self.passed else "fail"}


@dataclass
class ForecastResult:
    """The verdict of ``judge_forecast``.

    Attributes:
        metrics: one ``MetricResult`` per metric both sides have, in ``METRICS`` order.
        windows: the ``TOP_WINDOWS`` windows whose ``ranked_by`` metric differs most, ``(label,
            target value, reference value, relative difference)``, largest first.
        ranked_by: the metric the windows are ranked by (``crps`` when both sides have it).
        problems: what could not be compared.
    """

    metrics: list[MetricResult]
    windows: list[tuple[str, float, float, float]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    ranked_by: str = "crps"

    @property
    def passed(self) -> bool:
        return not self.problems and all(m.passed for m in self.metrics)

    def format(self) -> str:
        """The metrics on both sides, then the windows to drill into."""
        lines = ["forecast on held-out windows: " + "; ".join(
            f"{m.name} {m.target:.4g} vs {m.reference:.4g} (rel. diff {m.rel_diff:.3g}"
            + (f" > {m.limit:g})" if not m.passed else ")") for m in self.metrics)]
        if self.windows:
            lines.append(f"  windows whose {self.ranked_by.upper()} differs most: " + "; ".join(
                f"{label} ({t:.4g} vs {r:.4g}, rel. diff {d:.3g})" for label, t, r, d in self.windows))
        lines += [f"  {p}" for p in self.problems]
        return "\n".join(lines)


def judge_forecast(actual: Mapping[str, Any], expected: Mapping[str, Any], limit: float | None,
                   labels: Sequence[str] | None = None) -> ForecastResult:
    """Judge the target's per-window metrics ``actual`` against the reference's ``expected``.

    Args:
        actual, expected: ``forecast.<metric>`` -> 1-D tensor ``[W]`` (per window), as
            ``forecast_metrics`` gives them (``mse``, ``mae``, ``crps`` first, then any other metric the
            reference has, each judged the same way); names without the prefix are ignored.
        limit: largest relative difference of each metric's mean over the windows that passes
            (None: reported only).
        labels: one label per window (e.g. ``"elnino 1955-01"``), for the windows list; default
            ``"window <i>"``.

    Returns:
        A ``ForecastResult``: passes when every metric both sides have is within ``limit`` (a
        ``labels`` list of the wrong length is a problem).
    """
    metrics, problems, windows, per_window = [], [], [], {}
    others = sorted(k[len(PREFIX):] for k in expected if k.startswith(PREFIX) and k[len(PREFIX):] not in METRICS)
    for name in [m for m in METRICS if PREFIX + m in expected] + others:
        key = PREFIX + name
        if key not in actual:
            problems.append(f"{key}: recorded by the reference, missing on the target")
            continue
        a = torch.as_tensor(actual[key]).detach().to("cpu", torch.float64).reshape(-1)
        e = torch.as_tensor(expected[key]).detach().to("cpu", torch.float64).reshape(-1)
        if a.shape != e.shape or not (torch.isfinite(a).all() and torch.isfinite(e).all()):
            problems.append(f"{key}: {a.numel()} and {e.numel()} windows, or NaN/Inf: cannot be compared")
            continue
        t, r = float(a.mean()), float(e.mean())
        metrics.append(MetricResult(name, t, r, abs(t - r) / max(abs(r), torch.finfo(torch.float64).tiny), limit))
        per_window[name] = (a, e)
    ranked_by = "crps" if "crps" in per_window else next(iter(per_window), "crps")
    if ranked_by in per_window:
        a, e = per_window[ranked_by]
        if labels is not None and len(labels) != a.numel():
            problems.append(f"window_labels: {len(labels)} labels for {a.numel()} held-out windows; give one per window")
        rel = (a - e).abs() / e.abs().clamp_min(torch.finfo(torch.float64).tiny)
        names = list(labels) if labels is not None and len(labels) == a.numel() else \
            [f"window {i}" for i in range(a.numel())]
        for i in rel.argsort(descending=True)[:TOP_WINDOWS].tolist():
            windows.append((names[i], float(a[i]), float(e[i]), float(rel[i])))
    return ForecastResult(metrics, windows, problems, ranked_by)
