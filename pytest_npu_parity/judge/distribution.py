"""Distribution-level parity of sampling computations: two sets of samples, one verdict.

A sampler (``AuroraForPrediction.generate(num_samples=S)``, ``FlowLoss.sample``) turns random noise
into samples. When the reference and the target draw their noise from one shared stream
(``rng.same_randomness``, the default), their samples can be compared one by one. When they cannot
(each side draws from its own device's generator: ``--parity-rng device``, or a baseline recorded
that way), sample-by-sample comparison is meaningless (seed ``001_*`` §8.4: "若模型含随机采样，
逐样本对比无意义，应比较分布级指标"), and the two sample sets are compared as distributions.

Layout. A leaf holds samples along ``sample_dim``; the dimensions before it index **groups**
(one conditioning input each: a series of the batch, a token's row), those after it **features**
(forecast steps). Within a group the samples are i.i.d.; groups have different distributions and
are never pooled. Both sides need the same group and feature shape; their sample counts may differ.

Statistics (per group, on features standardized by the pooled standard deviation of both sides,
which the permutations do not change; features whose pooled spread is zero are left out):

==============  ===================================================================================
``mean``        mean over groups and features of the squared difference of the two sides' means
                (per-step location)
``spread``      | mean over groups and features of log(std_target / std_reference) |, standard
                deviations with ``n - 1`` (a systematic change of scale: noise scale, temperature)
``quantiles``   mean over groups, features and the levels of ``DistributionPolicy.quantiles`` of
                (F_target(c) − F_reference(c))², ``c`` the pooled sample's quantile, ``F`` the
                empirical CDFs (a discretized Cramér–von Mises distance at fixed levels)
``energy``      mean over groups of the multivariate energy distance of the two sample sets in
                feature space (:func:`energy_distance`; Székely & Rizzo)
==============  ===================================================================================

Verdict: one permutation test of "both sides sample the same distribution". Under that hypothesis
the pooled samples of a group are exchangeable, so reassigning them at random to the two sides
(independently per group, ``DistributionPolicy.permutations`` times, from a NumPy PCG64 stream of
``DistributionPolicy.seed``: the verdict is deterministic and touches no global random state) gives
the null distribution of every statistic. The four statistics are combined by single-step maxT
(Westfall & Young, *Resampling-Based Multiple Testing*, Wiley 1993, §2.6): each statistic is
standardized by the mean and standard deviation of its values over the observed assignment and all
permutations, the combined statistic is the largest standardized one, and its p-value is
``(1 + #{permutations at least as large}) / (1 + permutations)``. Standardizing by moments of the
whole (exchangeable) set keeps the test exact, and the floor of the p-value stays
``1 / (1 + permutations)`` whatever the number of statistics (a Bonferroni or min-p combination of
four statistics would need about four times the permutations for the same ``alpha``). A leaf fails
when the combined p-value is at most ``alpha`` (default 1e-3: the false-failure rate of one leaf
when both sides are right, by construction; measured in ``benchmarks/calibrate_distribution.py``).
The per-statistic (marginal) p-values and the effect sizes — largest |Δ mean| and |Δ quantile| in
pooled standard deviations, the geometric-mean spread ratio — are reported alongside.

What it can see: a distribution test resolves what the sample count allows, no more. Measured on
the tiny Aurora's flow sampler, 16 series × 64 samples (docs/explanation/distribution.md): noise
scaled by 1.05 fails 20 of 20 seeds; its final layer's weight scaled by 1 + 1e-4 or 1 + 1e-2 fails
none of 5, by 1.1 all 5. Faults that small need the shared stream's sample-by-sample checks.

The engine does not import pytest. (The old import path ``pytest_npu_parity.distribution`` re-exports
every name of this module.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..leaves import flatten
from .allclose import compare_tensors
from .tolerance import Tolerance, default_for_dtype

__all__ = [
    "STATISTICS",
    "DistributionPolicy",
    "DistributionLeaf",
    "DistributionResult",
    "SampleSummary",
    "energy_distance",
    "summarize_samples",
    "compare_samples",
    "compare_distributions",
]

#: The statistics of the permutation test, in report order.
STATISTICS = ("mean", "spread", "quantiles", "energy")
#: A feature whose pooled standard deviation is at most this share of the pooled data's largest
#: magnitude (or exactly 0) has no spread to compare and is left out (float32 rounding is ~6e-8).
_SPREAD_FLOOR = 1e-9
#: Permutations are evaluated this many at a time (bounds memory: chunk × groups × features × levels).
_CHUNK = 250


@dataclass(frozen=True)
class DistributionPolicy:
    """How two sample sets are judged.

    Attributes:
        alpha: a leaf fails when the combined permutation p-value is <= alpha; the false-failure
            rate of one leaf when both sides sample the same distribution (default 1e-3).
        permutations: random reassignments of the pooled samples (default 1999, so the smallest
            p-value is 1/2000 = 5e-4 < alpha).
        seed: seed of the permutations (NumPy PCG64); the verdict is a deterministic function of the
            two sample sets and this seed.
        quantiles: the levels of the per-step quantiles and of the ``quantiles`` statistic.
        min_samples: fewest samples per side and group a comparison accepts (fewer: a failing leaf
            saying so).
        source, reason: where the policy came from (``default``, ``check``) and why, for reports.

    Raises:
        ValueError: alpha outside (0, 1), fewer permutations than ``1/alpha - 1`` (a p-value could
            never reach alpha), a quantile level outside (0, 1), or min_samples < 2.
    """

    alpha: float = 1e-3
    permutations: int = 1999
    seed: int = 0
    quantiles: tuple[float, ...] = (0.05, 0.25, 0.5, 0.75, 0.95)
    min_samples: int = 8
    source: str = "default"
    reason: str | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha < 1.0:
            raise ValueError(f"distribution policy: alpha must be in (0, 1), got {self.alpha!r}")
        if not isinstance(self.permutations, int) or (self.permutations + 1) * self.alpha < 1.0:
            raise ValueError(f"distribution policy: permutations={self.permutations!r} cannot reach alpha="
                             f"{self.alpha:g} (the smallest p-value is 1/(permutations + 1)); use at least "
                             f"{math.ceil(1.0 / self.alpha) - 1}")
        if not self.quantiles or any(not 0.0 < q < 1.0 for q in self.quantiles):
            raise ValueError(f"distribution policy: quantile levels must lie in (0, 1), got {self.quantiles!r}")
        if self.min_samples < 2:
            raise ValueError(f"distribution policy: min_samples must be >= 2, got {self.min_samples!r}")

    def describe(self) -> str:
        """``distribution alpha=0.001 permutations=1999`` (+ `` [source: reason]`` when not the default)."""
        text = f"distribution alpha={self.alpha:g} permutations={self.permutations}"
        if self.source != "default" or self.reason:
            text += f" [{self.source}" + (f": {self.reason}" if self.reason else "") + "]"
        return text


@dataclass
class SampleSummary:
    """Per-step statistics of one sample set, float64 ``[groups, features]`` each.

    Attributes:
        mean, std: over the samples (``std`` with ``n - 1``).
        quantiles: ``{level: [groups, features]}`` (linear interpolation, ``torch.quantile``).
        samples: samples per group.
    """

    mean: torch.Tensor
    std: torch.Tensor
    quantiles: dict[float, torch.Tensor]
    samples: int


def _as_groups(t: torch.Tensor, sample_dim: int) -> torch.Tensor:
    """``[..., S (at sample_dim), ...]`` → float64 CPU ``[groups, S, features]``."""
    x = t.detach().to("cpu", torch.float64)
    x = x.movedim(sample_dim, 0) if x.dim() else x.reshape(1)
    samples = x.shape[0]
    groups = math.prod(t.shape[:sample_dim]) if t.dim() else 1
    # x is [S, *group dims, *feature dims]: put S second, then flatten
    x = x.reshape(samples, groups, -1).transpose(0, 1)
    return x.contiguous()


def _normalize_dim(sample_dim: int, ndim: int, path: str) -> int:
    if not isinstance(sample_dim, int) or isinstance(sample_dim, bool):
        raise TypeError(f"sample_dim must be an int, got {sample_dim!r}")
    dim = sample_dim + ndim if sample_dim < 0 else sample_dim
    if not 0 <= dim < max(ndim, 1) or ndim == 0:
        raise ValueError(f"output {path or '<output>'!r}: sample_dim={sample_dim} is not a dimension of a "
                         f"{ndim}-d tensor")
    return dim


def summarize_samples(samples: torch.Tensor, sample_dim: int = 1,
                      quantiles: tuple[float, ...] = DistributionPolicy.quantiles) -> SampleSummary:
    """Per-step mean, standard deviation and quantiles of ``samples`` along ``sample_dim``.

    Args:
        samples: any float tensor; dims before ``sample_dim`` are groups, dims after are features.
        sample_dim: the axis of i.i.d. samples (e.g. 1 for ``generate``'s ``[batch, num_samples, horizon]``).
        quantiles: levels in (0, 1).
    Returns:
        A :class:`SampleSummary` (float64, ``[groups, features]``).
    Raises:
        ValueError: ``sample_dim`` is not a dimension of ``samples`` or it holds fewer than 2 samples.
    """
    dim = _normalize_dim(sample_dim, samples.dim(), "")
    x = _as_groups(samples, dim)
    if x.shape[1] < 2:
        raise ValueError(f"summarize_samples: the sample axis {sample_dim} holds {x.shape[1]} sample(s); need >= 2")
    levels = torch.tensor(quantiles, dtype=torch.float64)
    q = torch.quantile(x, levels, dim=1)  # [Q, G, F]
    return SampleSummary(mean=x.mean(1), std=x.std(1), quantiles={float(lv): q[i] for i, lv in enumerate(quantiles)},
                         samples=int(x.shape[1]))


def energy_distance(x: torch.Tensor, y: torch.Tensor) -> float:
    """The energy distance of two samples in R^d (the squared form, a V-statistic).

    ``E = 2/(n m) Σ_ij ‖x_i − y_j‖ − 1/n² Σ_ij ‖x_i − x_j‖ − 1/m² Σ_ij ‖y_i − y_j‖``: Székely & Rizzo,
    "Testing for equal distributions in high dimension", InterStat 2004, and "Energy statistics: a
    class of statistics based on distances", J. Statist. Plann. Inference 143 (2013) 1249–1272,
    eq. (2.1) with empirical distributions. E ≥ 0, and E = 0 only when the two empirical
    distributions are equal. In one dimension it is the square of ``scipy.stats.energy_distance``
    (scipy's docstring: ``D(u, v) = (2E|X−Y| − E|X−X'| − E|Y−Y'|)^(1/2)``), which handles 1-D only.

    Args:
        x: ``[n, d]`` (or ``[n]`` for d = 1), any float dtype; computed in float64 on the CPU.
        y: ``[m, d]`` (or ``[m]``).
    Returns:
        E as a float.
    Raises:
        ValueError: empty samples or different feature dimensions.
    """
    x = x.detach().to("cpu", torch.float64)
    y = y.detach().to("cpu", torch.float64)
    if not x.numel() or not y.numel():
        raise ValueError("energy_distance: both samples need at least one point")
    x = x.reshape(-1, 1) if x.dim() == 1 else x.reshape(x.shape[0], -1)
    y = y.reshape(-1, 1) if y.dim() == 1 else y.reshape(y.shape[0], -1)
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"energy_distance: feature dimensions differ ({x.shape[1]} vs {y.shape[1]})")
    return float(2.0 * torch.cdist(x, y).mean() - torch.cdist(x, x).mean() - torch.cdist(y, y).mean())


@dataclass
class DistributionLeaf:
    """Metrics and verdict of one output leaf compared as two sample sets.

    ``shape``/``dtype`` are the target's, ``expected_*`` the reference's. ``statistics`` holds the
    observed value of each of :data:`STATISTICS`, ``pvalues`` their marginal permutation p-values,
    ``pvalue`` the combined (maxT) p-value the verdict uses. Effect sizes, in pooled standard
    deviations: ``mean_shift`` = max |Δ mean| over groups and features (``mean_shift_index`` =
    (group, feature)), ``quantile_shift`` = max |Δ quantile| over levels, groups and features;
    ``spread_ratio`` = exp(mean log(std_target / std_reference)), with ``spread_ratio_min``/``_max``
    over groups and features. ``features_used`` counts (group, feature) pairs with spread.
    ``problem`` explains a leaf that could not be compared (shape, dtype, too few samples,
    NaN/Inf); metrics are NaN then.
    """

    path: str
    policy: DistributionPolicy
    sample_dim: int
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    expected_shape: tuple[int, ...] | None = None
    expected_dtype: str | None = None
    numel: int = 0
    groups: int = 0
    samples: int = 0
    expected_samples: int = 0
    features: int = 0
    features_used: int = 0
    statistics: dict[str, float] = field(default_factory=dict)
    pvalues: dict[str, float] = field(default_factory=dict)
    pvalue: float = math.nan
    mean_shift: float = math.nan
    mean_shift_index: tuple[int, int] | None = None
    quantile_shift: float = math.nan
    spread_ratio: float = math.nan
    spread_ratio_min: float = math.nan
    spread_ratio_max: float = math.nan
    problem: str | None = None
    note: str | None = None

    @property
    def passed(self) -> bool:
        """No problem, and the combined p-value above ``alpha`` (a NaN p-value fails)."""
        return self.problem is None and self.pvalue > self.policy.alpha

    @property
    def err_ratio(self) -> float:
        """``alpha / pvalue``: > 1 fails (the report ranks leaves by it, as allclose's err/tol)."""
        if self.problem is not None:
            return math.inf
        return self.policy.alpha / self.pvalue if self.pvalue > 0 else math.inf

    # Fields allclose leaves have and the report tables read; a distribution leaf has no such numbers.
    max_abs = max_rel = rel_l2 = cosine = math.nan
    mismatched = 0

    def to_row(self) -> dict[str, Any]:
        """A flat, JSON-able dict (the report's row schema plus ``dist_*`` columns)."""
        row = {
            "leaf": self.path,
            "shape": "x".join(map(str, self.shape)) if self.shape is not None else None,
            "dtype": self.dtype,
            "numel": self.numel,
            "max_abs": math.nan, "max_rel": math.nan, "rel_l2": math.nan, "cosine": math.nan,
            "err_ratio": self.err_ratio,
            "mismatched": None, "mismatched_frac": None, "nonfinite_mismatched": None,
            "rtol": None, "atol": None, "budget": None,
            "tolerance_source": self.policy.source, "tolerance_reason": self.policy.reason,
            "problem": self.problem,
            "dist_sample_dim": self.sample_dim,
            "dist_groups": self.groups, "dist_samples": self.samples, "dist_expected_samples": self.expected_samples,
            "dist_features": self.features,
            "dist_pvalue": self.pvalue, "dist_alpha": self.policy.alpha,
            "dist_permutations": self.policy.permutations,
            "dist_mean_shift": self.mean_shift, "dist_quantile_shift": self.quantile_shift,
            "dist_spread_ratio": self.spread_ratio,
            "verdict": "pass" if self.passed else "fail",
        }
        for name in STATISTICS:
            row[f"dist_{name}"] = self.statistics.get(name, math.nan)
            row[f"dist_{name}_pvalue"] = self.pvalues.get(name, math.nan)
        return row


@dataclass
class DistributionResult:
    """All leaves of one distribution comparison (same interface as ``compare.CompareResult``).

    ``leaves`` holds :class:`DistributionLeaf` for floating leaves and ``compare.LeafResult`` (exact
    comparison) for integer/bool ones.
    """

    name: str
    leaves: list[Any] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(leaf.passed for leaf in self.leaves)

    @property
    def failures(self) -> list[Any]:
        return [leaf for leaf in self.leaves if not leaf.passed]

    def __bool__(self) -> bool:
        return self.passed

    def format(self, context: str = "") -> str:
        """The failure message: what failed, then one line per leaf with its statistics."""
        failures = self.failures
        verdict = "failed" if failures else "passed"
        lines = [f"Parity check {self.name!r} {verdict} as a distribution" + (f" ({context})" if context else "")]
        for leaf in failures:
            where = f"output {leaf.path!r}: " if leaf.path else ""
            if not isinstance(leaf, DistributionLeaf):
                lines.append(f"{where}compared exactly (integer/bool): {leaf.problem or f'{leaf.mismatched} mismatched'}")
            elif leaf.problem is not None:
                lines.append(f"{where}{leaf.problem}")
            else:
                worst = max(STATISTICS, key=lambda s: -leaf.pvalues.get(s, 1.0))
                lines.append(
                    f"{where}the samples differ in distribution: combined permutation p-value {leaf.pvalue:.3g} <= "
                    f"alpha {leaf.policy.alpha:g} (most significant: {worst}, marginal p {leaf.pvalues.get(worst, math.nan):.3g})")
        lines.append("")
        lines += format_table([leaf for leaf in self.leaves if isinstance(leaf, DistributionLeaf)])
        return "\n".join(lines)

    def raise_if_failed(self, context: str = "") -> None:
        """Raise ``compare.ParityError`` with ``format(context)`` when any leaf failed."""
        if not self.passed:
            from .allclose import ParityError

            raise ParityError(self.format(context), self)


_TABLE = ("leaf", "groups x samples x features", "p", "mean shift", "spread ratio", "quantile shift", "energy",
          "marginal p (mean/spread/quantiles/energy)", "policy")


def format_table(leaves: list[DistributionLeaf]) -> list[str]:
    """Fixed-width text table of distribution leaves (one line each)."""
    rows = [_TABLE]
    for leaf in leaves:
        layout = f"{leaf.groups}x{leaf.samples}/{leaf.expected_samples}x{leaf.features}"
        if leaf.problem is not None:
            rows.append((leaf.path or "<output>", layout, "-", "-", "-", "-", "-", "-", leaf.problem))
            continue
        rows.append((
            leaf.path or "<output>", layout, f"{leaf.pvalue:.3g}", f"{leaf.mean_shift:.3g} sd",
            f"{leaf.spread_ratio:.4f}", f"{leaf.quantile_shift:.3g} sd", f"{leaf.statistics.get('energy', math.nan):.3g}",
            "/".join(f"{leaf.pvalues.get(s, math.nan):.3g}" for s in STATISTICS), leaf.policy.describe()))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(_TABLE))]
    return ["  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


# --------------------------------------------------------------------------------------------
# the permutation test


def _statistics(member: torch.Tensor, z: torch.Tensor, below: torch.Tensor, dist: torch.Tensor,
                used: torch.Tensor, q_used: torch.Tensor, n_target: int) -> torch.Tensor:
    """The four statistics for a batch of assignments (float32: the observed assignment and the
    permutations are computed alike, so rounding cannot favour either).

    Args:
        member: ``[G, R, N]``, 1 where a pooled sample is assigned to the target.
        z: standardized pooled samples ``[G, N, F]`` (features without spread zeroed).
        below: ``[G, N, F*Q]``, 1 where a sample is <= its feature's pooled quantile.
        dist: ``[G, N, N]`` pairwise Euclidean distances of the pooled samples.
        used, q_used: ``[G*F]`` / ``[G*F*Q]`` weights, 1/count for (group, feature) pairs with spread.
        n_target: samples assigned to the target (m); the reference gets ``N - m``.
    Returns:
        ``[R, 4]``: mean, spread, quantiles, energy per assignment (averaged over groups).
    """
    g, r, n_all = member.shape
    m, n = float(n_target), float(n_all - n_target)
    s_t = torch.bmm(member, z)                                   # [G, R, F]: Σ_target z
    sq_t = torch.bmm(member, z * z)
    total, total_sq = z.sum(1, keepdim=True), (z * z).sum(1, keepdim=True)
    mean_diff = s_t * (1.0 / m + 1.0 / n) - total / n            # mean_target − mean_reference
    var_t = (sq_t - s_t * s_t / m) / (m - 1.0)
    rest = total - s_t
    var_r = (total_sq - sq_t - rest * rest / n) / (n - 1.0)
    per_pair = lambda t: t.transpose(0, 1).reshape(r, -1)        # noqa: E731  [R, G*F]
    mean_stat = (per_pair(mean_diff) ** 2) @ used
    log_ratio = 0.5 * (torch.log(var_t.clamp_min(1e-30)) - torch.log(var_r.clamp_min(1e-30)))
    spread_stat = (per_pair(log_ratio) @ used).abs()
    c_t = torch.bmm(member, below)                               # [G, R, F*Q]: target counts below
    c_diff = c_t * (1.0 / m + 1.0 / n) - below.sum(1, keepdim=True) / n
    quant_stat = (per_pair(c_diff) ** 2) @ q_used
    row_t = torch.bmm(member, dist)                              # [G, R, N]: Σ_{i ∈ target} D_ij
    s_tt = (row_t * member).sum(-1)                              # Σ_{i, j ∈ target} D_ij
    s_t_all = (member * dist.sum(-1).unsqueeze(1)).sum(-1)       # Σ_{i ∈ target, j} D_ij
    s_all = dist.sum((1, 2)).unsqueeze(-1)
    s_tr, s_rr = s_t_all - s_tt, s_all - 2.0 * s_t_all + s_tt
    energy = 2.0 * s_tr / (m * n) - s_tt / (m * m) - s_rr / (n * n)   # [G, R]
    return torch.stack([mean_stat, spread_stat, quant_stat, energy.mean(0)], dim=-1)


def _map_single_threaded(fn: Any, items: list) -> list:
    """``[fn(item) for item in items]``, each call with one intra-op thread.

    The tensors of a permutation chunk are small (a few MB): with an intra-op thread team, their
    ops cost more in thread hand-offs than in arithmetic (measured on a loaded 2-core machine: 1.7 s
    of CPU time with 2 threads, 0.05 s with 1, for one 8x32x48 comparison). Where ``torch.set_num_threads``
    is per thread (ATen's OpenMP backend, ``compare._per_thread_intra_op``) the chunks run on up to
    ``torch.get_num_threads()`` worker threads pinned to one intra-op thread each (results in
    order, so the verdict does not depend on the thread count); elsewhere in the calling thread.
    """
    from concurrent.futures import ThreadPoolExecutor

    from .allclose import _per_thread_intra_op

    workers = min(torch.get_num_threads(), len(items))
    if not _per_thread_intra_op():
        return [fn(item) for item in items]

    def pinned(item: Any) -> Any:
        torch.set_num_threads(1)  # this worker thread only
        return fn(item)

    with ThreadPoolExecutor(max_workers=max(workers, 1), thread_name_prefix="npu-parity-dist") as pool:
        return list(pool.map(pinned, items))


def compare_samples(actual: torch.Tensor, expected: torch.Tensor, sample_dim: int = 1,
                    policy: DistributionPolicy | None = None, *, path: str = "") -> DistributionLeaf:
    """Judge two sample tensors as distributions (see the module docstring).

    Args:
        actual: the target's samples, float, any device; ``[*groups, S_t, *features]``.
        expected: the reference's samples, same dtype and same shape except along ``sample_dim``.
        sample_dim: the axis of i.i.d. samples (negative counts from the end).
        policy: a :class:`DistributionPolicy` (default ``DistributionPolicy()``).
        path: the leaf's path, for messages.
    Returns:
        A :class:`DistributionLeaf`; shape/dtype mismatches, too few samples and NaN/Inf give a
        failing leaf with ``problem`` set, never an exception.
    Raises:
        TypeError: a side is not a floating tensor, or ``sample_dim`` is not an int.
        ValueError: ``sample_dim`` is not a dimension of the tensors.
    """
    policy = policy or DistributionPolicy()
    for side, t in (("actual", actual), ("expected", expected)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"compare_samples: {side} must be a floating tensor, got "
                            f"{getattr(t, 'dtype', type(t).__name__)}")
    dim = _normalize_dim(sample_dim, expected.dim(), path)
    leaf = DistributionLeaf(path=path, policy=policy, sample_dim=dim, shape=tuple(actual.shape),
                            dtype=str(actual.dtype).removeprefix("torch."), expected_shape=tuple(expected.shape),
                            expected_dtype=str(expected.dtype).removeprefix("torch."), numel=actual.numel())
    leaf.problem = _mismatch(leaf, actual, expected, dim)
    if leaf.problem is not None:
        return leaf
    y, x = _as_groups(actual, dim), _as_groups(expected, dim)   # target, reference: [G, S, F]
    leaf.groups, leaf.samples, leaf.expected_samples, leaf.features = x.shape[0], y.shape[1], x.shape[1], x.shape[2]
    leaf.problem = _samples_problem(y, x, dim, policy)
    if leaf.problem is not None:
        return leaf
    pooled = torch.cat([x, y], dim=1)                    # [G, N, F]: reference first, then target
    center = pooled.mean(1, keepdim=True)
    scale = pooled.std(1, keepdim=True)
    magnitude = pooled.abs().amax(1, keepdim=True)
    used = (scale > _SPREAD_FLOOR * magnitude) & (scale > 0)
    leaf.features_used = int(used.sum())
    if not leaf.features_used:
        return _without_spread(leaf)
    z = torch.where(used, (pooled - center) / torch.where(used, scale, torch.ones_like(scale)), torch.zeros_like(pooled))
    _permutation_test(leaf, z, used, x.shape[1], policy)
    _effect_sizes(leaf, z, used, x.shape[1], policy)
    if leaf.features_used < x.shape[0] * x.shape[2]:
        leaf.note = f"{x.shape[0] * x.shape[2] - leaf.features_used} (group, feature) pairs without spread left out"
    return leaf


def _mismatch(leaf: DistributionLeaf, actual: torch.Tensor, expected: torch.Tensor, dim: int) -> str | None:
    """``compare_samples``' dtype or shape mismatch (apart from the sample axis ``dim``), or None."""
    if actual.dtype != expected.dtype:
        return f"dtype mismatch: actual {leaf.dtype}, expected {leaf.expected_dtype}"
    others = lambda s: s[:dim] + s[dim + 1:]  # noqa: E731
    if actual.dim() != expected.dim() or others(tuple(actual.shape)) != others(tuple(expected.shape)):
        return (f"shape mismatch apart from the sample axis {dim}: actual {tuple(actual.shape)}, "
                f"expected {tuple(expected.shape)}")
    return None


def _samples_problem(y: torch.Tensor, x: torch.Tensor, dim: int, policy: DistributionPolicy) -> str | None:
    """Why the target's ``y`` and the reference's ``x`` samples (``[G, S, F]``) cannot be compared
    (too few, NaN/Inf, no features), or None."""
    if min(x.shape[1], y.shape[1]) < policy.min_samples:
        return (f"too few samples for a distribution comparison: {y.shape[1]} (target) and {x.shape[1]} "
                f"(reference) along axis {dim}, at least {policy.min_samples} each are needed "
                "(draw more, e.g. num_samples=32)")
    bad_t, bad_r = int((~torch.isfinite(y)).sum()), int((~torch.isfinite(x)).sum())
    if bad_t or bad_r:
        return f"NaN/Inf among the samples: {bad_t} (target), {bad_r} (reference)"
    if not x.numel():
        return "no features to compare (an empty leaf)"
    return None


def _without_spread(leaf: DistributionLeaf) -> DistributionLeaf:
    """``leaf`` where every sample of both sides is the same number: equal (a deterministic sampler) passes."""
    leaf.statistics = dict.fromkeys(STATISTICS, 0.0)
    leaf.pvalues = dict.fromkeys(STATISTICS, 1.0)
    leaf.pvalue, leaf.mean_shift, leaf.quantile_shift = 1.0, 0.0, 0.0
    leaf.spread_ratio = leaf.spread_ratio_min = leaf.spread_ratio_max = 1.0
    leaf.note = "no spread: every sample equal on both sides"
    return leaf


def _permutation_test(leaf: DistributionLeaf, z: torch.Tensor, used: torch.Tensor, n_ref: int,
                      policy: DistributionPolicy) -> None:
    """Set ``leaf``'s ``statistics``, their marginal ``pvalues`` and the combined ``pvalue`` of the
    pooled standardized samples ``z`` (``[G, N, F]``: the reference's ``n_ref`` first, then the
    target's; ``used`` the features with spread) over ``policy.permutations`` random assignments."""
    n_all = z.shape[1]
    n_target = n_all - n_ref
    levels = torch.tensor(policy.quantiles, dtype=torch.float64)
    cut = torch.quantile(z, levels, dim=1).permute(1, 2, 0)        # [G, F, Q]
    q = len(policy.quantiles)
    below = (z.unsqueeze(-1) <= cut.unsqueeze(1)).reshape(z.shape[0], n_all, -1).to(torch.float32)
    dist = torch.cdist(z, z).to(torch.float32)                      # [G, N, N]
    flags = used[:, 0].reshape(-1).to(torch.float32)                # [G*F]
    weights = flags / flags.sum()
    q_weights = flags.repeat_interleave(q) / (flags.sum() * q)
    z32 = z.to(torch.float32)
    observed = torch.zeros(z.shape[0], 1, n_all, dtype=torch.float32)
    observed[:, :, n_ref:] = 1.0
    rng = np.random.Generator(np.random.PCG64(policy.seed))
    orders = [np.argsort(rng.random((z.shape[0], min(_CHUNK, policy.permutations - start), n_all)), axis=-1)
              [..., :n_target] for start in range(0, policy.permutations, _CHUNK)]

    def chunk(order: np.ndarray | None) -> torch.Tensor:
        if order is None:
            return _statistics(observed, z32, below, dist, weights, q_weights, n_target)
        member = torch.zeros(order.shape[0], order.shape[1], n_all, dtype=torch.float32)
        member.scatter_(-1, torch.from_numpy(order), 1.0)
        return _statistics(member, z32, below, dist, weights, q_weights, n_target)

    stats = _map_single_threaded(chunk, [None, *orders])
    all_stats = torch.cat(stats, dim=0).to(torch.float64)           # [1 + R, 4]; row 0 observed
    obs = all_stats[0]
    marginal = (all_stats >= obs).sum(0).to(torch.float64) / all_stats.shape[0]
    sd = all_stats.std(0)
    standardized = (all_stats - all_stats.mean(0)) / torch.where(sd > 0, sd, torch.ones_like(sd))
    combined = standardized.max(dim=1).values
    leaf.pvalue = float((combined >= combined[0]).sum()) / all_stats.shape[0]
    leaf.statistics = {name: float(obs[i]) for i, name in enumerate(STATISTICS)}
    leaf.pvalues = {name: float(marginal[i]) for i, name in enumerate(STATISTICS)}


def _effect_sizes(leaf: DistributionLeaf, z: torch.Tensor, used: torch.Tensor, n_ref: int,
                  policy: DistributionPolicy) -> None:
    """Set ``leaf``'s effect sizes (in pooled standard deviations) on the observed assignment of ``z``
    (as ``_permutation_test``): ``mean_shift`` (and where), ``quantile_shift``, ``spread_ratio*``."""
    levels = torch.tensor(policy.quantiles, dtype=torch.float64)
    zt, zr = z[:, n_ref:], z[:, :n_ref]
    shift = (zt.mean(1) - zr.mean(1)).abs() * used[:, 0]
    flat = int(shift.argmax())
    leaf.mean_shift = float(shift.max())
    leaf.mean_shift_index = (flat // shift.shape[1], flat % shift.shape[1])
    q_t, q_r = torch.quantile(zt, levels, dim=1), torch.quantile(zr, levels, dim=1)
    leaf.quantile_shift = float(((q_t - q_r).abs() * used[:, 0]).max())
    ratio = torch.log(zt.std(1).clamp_min(1e-300)) - torch.log(zr.std(1).clamp_min(1e-300))
    ratio = ratio[used[:, 0]]
    leaf.spread_ratio = float(torch.exp(ratio.mean()))
    leaf.spread_ratio_min, leaf.spread_ratio_max = float(torch.exp(ratio.min())), float(torch.exp(ratio.max()))


def compare_distributions(actual: Any, expected: Any, sample_dim: int = 1, policy: DistributionPolicy | None = None,
                          *, name: str = "") -> DistributionResult:
    """Compare two nested outputs: floating leaves as sample sets along ``sample_dim``, integer and
    bool leaves exactly (``compare.compare_tensors``), structure as ``compare.compare`` does.

    Args:
        actual, expected: the target's and the reference's outputs (tensors or nested structures).
        sample_dim: the sample axis of every floating leaf.
        policy: a :class:`DistributionPolicy`.
        name: the check's name, for messages.
    Returns:
        A :class:`DistributionResult`.
    Raises:
        TypeError, ValueError: as :func:`compare_samples` and ``compare.flatten``.
    """
    from .allclose import LeafResult

    policy = policy or DistributionPolicy()
    result = DistributionResult(name=name)
    got, want = dict(flatten(actual)), dict(flatten(expected))
    for path in list(want) + [p for p in got if p not in want]:
        a, e = got.get(path), want.get(path)
        if path not in got or path not in want or a is None or e is None:
            if path in got and path in want and a is None and e is None:
                continue
            problem = ("missing in actual output" if path not in got else "not in expected output" if path not in want
                       else f"{'actual' if a is None else 'expected'} is None, the other is a tensor")
            result.leaves.append(DistributionLeaf(path=path, policy=policy, sample_dim=sample_dim, problem=problem))
        elif e.is_floating_point() and a.is_floating_point():
            result.leaves.append(compare_samples(a, e, sample_dim, policy, path=path))
        elif e.is_floating_point() or a.is_floating_point():
            result.leaves.append(DistributionLeaf(path=path, policy=policy, sample_dim=sample_dim,
                                                  problem=f"dtype mismatch: actual {a.dtype}, expected {e.dtype}"))
        else:
            tol: Tolerance = default_for_dtype(e.dtype)
            leaf: LeafResult = compare_tensors(a, e, tol, path)
            result.leaves.append(leaf)
    return result
