"""How far one side is from the golden, by our definitions (the ``golden`` limit set).

``SideMetrics`` holds one side's errors against the golden (rmse, max_rel, mean_rel, small_share,
balance, and the counts of small and normal golden elements); ``_SideSums`` takes them block by
block, ``side_metrics`` in one go; ``ratio`` is target / max(reference, floor). The formulas, and
where each limit on them comes from, are in ``judge.golden``'s module docstring. msprobe's own
definitions of the same metrics are ``judge.msprobe._MsprobeSums``, which fills the same
``SideMetrics``.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch


@dataclass
class SideMetrics:
    """Errors of one side (target, reference, or the golden rounded to the leaf dtype) against the golden.

    ``rmse`` and ``max_abs`` (the largest |x − g|) are in tensor units, the others dimensionless;
    ``small``/``normal`` count the golden's small and normal elements among positions finite on all
    three tensors.
    """

    rmse: float = 0.0
    max_rel: float = 0.0
    mean_rel: float = 0.0
    small_share: float = 0.0
    balance: float = 0.0
    small: int = 0
    normal: int = 0
    max_abs: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


class _SideSums:
    """Blockwise sums behind ``SideMetrics`` (our ``golden`` limit set): fold blocks with ``add``,
    read the metrics with ``result``."""

    def __init__(self) -> None:
        self.n = self.normal = self.small = self.small_wrong = self.above = self.below = 0
        self.sum_sq = self.sum_rel = 0.0
        self.max_rel = self.max_abs = 0.0

    def add(self, x: torch.Tensor, g: torch.Tensor, mask: torch.Tensor, small: torch.Tensor, small_atol: float) -> None:
        """Fold one block: 1-D float64 ``x`` and golden ``g``, positions ``mask``, small positions ``small``."""
        n = int(mask.sum())
        if n == 0:
            return
        if n == mask.numel():  # every position finite (the usual block): no boolean indexing, same sums
            self._add_all(x, g, small, small_atol)
            return
        self.n += n
        diff = (x - g)[mask]
        err = diff.abs()
        self.sum_sq += float(err.square().sum())
        self.max_abs = max(self.max_abs, float(err.max()))
        normal = mask & ~small
        k = int(normal.sum())
        if k:
            rel = (x[normal] - g[normal]).abs_().div_(g[normal].abs())
            self.normal += k
            self.sum_rel += float(rel.sum())
            self._fold_max_rel(float(rel.max()))
        k = int(small.sum())
        if k:
            self.small += k
            self.small_wrong += int(((x[small] - g[small]).abs_() > small_atol).sum())
        self.above += int((diff > 0).sum())
        self.below += int((diff < 0).sum())

    def _add_all(self, x: torch.Tensor, g: torch.Tensor, small: torch.Tensor, small_atol: float) -> None:
        """``add`` for a block whose positions are all in the mask: the same elements in the same
        order enter every sum (bitwise the same metrics), without the copies boolean indexing makes
        (about twice as fast on 1 M-element blocks)."""
        n = x.numel()
        self.n += n
        diff = x - g
        err = diff.abs()
        self.sum_sq += float(err.square().sum())
        self.max_abs = max(self.max_abs, float(err.max()))
        k_small = int(small.sum())
        if k_small < n:
            if k_small:
                normal = ~small
                rel = err[normal].div_(g[normal].abs())
            else:
                rel = err / g.abs()
            self.normal += n - k_small
            self.sum_rel += float(rel.sum())
            self._fold_max_rel(float(rel.max()))
        if k_small:
            self.small += k_small
            self.small_wrong += int((err[small] > small_atol).sum())
        self.above += int((diff > 0).sum())
        self.below += int((diff < 0).sum())

    def _fold_max_rel(self, block_max: float) -> None:
        """Fold a block's largest relative error. A NaN (a golden of exactly 0 counted as normal, under a
        small-value threshold of 0, against an equal value: 0/0) stays NaN, as ``torch.amax`` keeps it
        in ``segment_sums``: Python's ``max`` would drop it or keep it depending on the order."""
        if math.isnan(block_max) or block_max > self.max_rel:
            self.max_rel = block_max

    def result(self) -> SideMetrics:
        out = SideMetrics(small=self.small, normal=self.normal)
        if self.n == 0:
            return out
        out.rmse = math.sqrt(self.sum_sq / self.n)
        out.max_abs = self.max_abs
        if self.normal:
            out.max_rel, out.mean_rel = self.max_rel, self.sum_rel / self.normal
        if self.small:
            out.small_share = self.small_wrong / self.small
        out.balance = abs(self.above - self.below) / self.n
        return out


def segment_sums(x: torch.Tensor, g: torch.Tensor, mask: torch.Tensor, small: torch.Tensor, small_atol: float,
                 segment: torch.Tensor, count: int) -> list[_SideSums]:
    """``_SideSums`` of ``count`` leaves at once, each folded as ``_SideSums.add`` folds one block.

    Args:
        x: one side's values, the leaves' flat float64 values one after another (1-D, ``N`` elements).
        g: the golden values, aligned with ``x``.
        mask: positions to measure (bool, ``N``).
        small: positions (within ``mask``) where the golden is small (bool, ``N``).
        small_atol: absolute error above which a small element is wrong.
        segment: the leaf each position belongs to (int64, ``N``, values in ``[0, count)``).
        count: the number of leaves.

    Returns:
        One ``_SideSums`` per leaf, in leaf order. The counts equal ``_SideSums.add``'s; the float64
        sums are the same elements added in another order (``torch.bincount`` adds them one by one),
        so they may differ from a per-leaf ``add`` in the last bits, far below any limit's resolution.
        What it is for: a training step has hundreds of small leaves (505 on the tiny Aurora model),
        and judged one by one each costs about a hundred small tensor operations.
    """
    diff = x - g
    err = diff.abs()
    zero = torch.zeros((), dtype=err.dtype)
    normal = mask & ~small
    rel = torch.where(normal, err / g.abs(), zero)
    n = torch.bincount(segment[mask], minlength=count)
    sum_sq = torch.bincount(segment, weights=torch.where(mask, err.square(), zero), minlength=count)
    normals = torch.bincount(segment[normal], minlength=count)
    sum_rel = torch.bincount(segment, weights=rel, minlength=count)
    max_rel = torch.zeros(count, dtype=err.dtype).scatter_reduce_(0, segment, rel, "amax")
    max_abs = torch.zeros(count, dtype=err.dtype).scatter_reduce_(0, segment, torch.where(mask, err, zero), "amax")
    smalls = torch.bincount(segment[small], minlength=count)
    small_wrong = torch.bincount(segment[small & (err > small_atol)], minlength=count)
    above = torch.bincount(segment[mask & (diff > 0)], minlength=count)
    below = torch.bincount(segment[mask & (diff < 0)], minlength=count)
    sums = []
    for row in zip(*(t.tolist() for t in (n, sum_sq, normals, sum_rel, max_rel, max_abs, smalls, small_wrong, above,
                                          below))):
        one = _SideSums()
        (one.n, one.sum_sq, one.normal, one.sum_rel, one.max_rel, one.max_abs, one.small, one.small_wrong, one.above,
         one.below) = row
        sums.append(one)
    return sums


def side_metrics(x: torch.Tensor, g: torch.Tensor, mask: torch.Tensor, small: torch.Tensor,
                 small_atol: float) -> SideMetrics:
    """Errors of ``x`` against the golden ``g`` (1-D float64 tensors of equal length), our definitions.

    Args:
        x: one side's values.
        g: the golden values.
        mask: positions to measure (finite on every tensor of the comparison).
        small: positions (within ``mask``) where the golden is small.
        small_atol: absolute error above which a small element is wrong.

    Returns:
        ``SideMetrics`` (see the module docstring for the formulas; empty sets give 0).
    """
    sums = _SideSums()
    sums.add(x, g, mask, small, small_atol)
    return sums.result()


def ratio(target: float, reference: float, floor: float = 0.0) -> float:
    """``target / max(reference, floor)`` (our ``golden`` limit set); 1 when both are 0 (neither side
    has the error), ``inf`` when only the denominator is 0, NaN when an input is NaN."""
    denominator = max(reference, floor)
    if math.isnan(target) or math.isnan(denominator):
        return math.nan
    if denominator == 0:
        return 1.0 if target == 0 else math.inf
    return target / denominator
