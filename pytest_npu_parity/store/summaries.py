"""Input summaries: staleness that survives last-bit differences between machines.

``summarize_tensors(obj)`` gives order-sensitive float64 summaries of a nested structure's tensors and
``summaries_close`` compares two of them within :data:`SUMMARY_RTOL`, which tells last-bit differences of
recomputed activations (another CPU, other SIMD paths or thread counts) from a real change of input
(another window, seed or order).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .digests import _cache_fields

__all__ = ["SUMMARY_RTOL", "summarize_tensors", "summaries_close"]

#: Relative difference under which two input summaries describe the same data. Recomputing the
#: same activations on another CPU (x86-64 vs the Arm hosts of Ascend
#: servers, other SIMD paths or thread counts) changes last bits (~1e-7 relative); a different
#: input window, seed or checkpoint changes these sums at O(1e-2) or more.
SUMMARY_RTOL = 1e-4


#: Elements per block of the position-weighted sum (bounds the float64 temporaries it needs).
_PROJECTION_BLOCK = 1 << 20


def _position_weights(start: int, stop: int) -> torch.Tensor:
    """Weights in [-1, 1) of the flat positions ``start..stop-1``, float64: MurmurHash3's 32-bit
    finalizer of the position, scaled to [-1, 1). Integer arithmetic only (int64, low 32 bits), so
    every machine and torch version computes the same weights; a hash rather than a linear sequence,
    so that the weights of one row and of another are unrelated (a row swap always moves the sum)."""
    mask = 0xFFFFFFFF
    h = torch.arange(start, stop, dtype=torch.int64)
    h = (h ^ (h >> 32)) & mask
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & mask  # the product wraps in int64; its low 32 bits are exact
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & mask
    h = h ^ (h >> 16)
    return h.to(torch.float64) / float(1 << 31) - 1.0


def _position_weighted_sum(flat: torch.Tensor) -> float:
    """``sum_i w_i * x_i`` over a flat CPU tensor with ``_position_weights``, accumulated in float64."""
    total = 0.0
    for start in range(0, flat.numel(), _PROJECTION_BLOCK):
        block = flat[start:start + _PROJECTION_BLOCK].to(torch.float64)
        total += float((block * _position_weights(start, start + block.numel())).sum())
    return total


def _leaf_summary(name: str, tensor: torch.Tensor) -> list:
    t = tensor.detach()
    if t.device.type != "cpu":  # float64 reductions need the CPU (NPUs have no fp64)
        t = t.to("cpu")
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.numel() == 0:
        return [name, 0, 0.0, 0.0, 0.0, 0.0]
    if not t.is_floating_point():  # integer / bool leaves: small, exact in float64
        t = t.to(torch.float64)
    # Reductions accumulate in float64 without a float64 copy of the tensor (2.4x faster on a
    # 200 MB weight set than converting first; the totals agree to ~1e-12 relative).
    low, high = torch.aminmax(t)
    return [name, int(t.numel()), float(t.sum(dtype=torch.float64)),
            float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2, max(-float(low), float(high)),
            _position_weighted_sum(t.reshape(-1))]


def summarize_tensors(obj: Any) -> list:
    """Per tensor leaf of a nested structure: ``[path, numel, sum, sum of squares, max |x|,
    position-weighted sum]`` (float64 numbers; ``path`` as ``.key``/``[i]``; a Hugging Face
    key/value cache is walked as its ``compare.cache_fields``).

    The position-weighted sum ``sum_i w_i x_i`` (``w_i`` in [-1, 1) a hash of the flat position
    ``i``) makes the summary order-sensitive: the same values in another order (rows swapped, a
    transposed copy) change it by about the norm of what moved, while the other four numbers do
    not change at all. Used with ``summaries_close`` to tell a real change of input (another
    window, another seed, another order) from last-bit differences of the same computation on
    another machine.
    """
    out: list = []

    def walk(value: Any, path: str) -> None:
        if isinstance(value, torch.Tensor):
            out.append(_leaf_summary(path, value))
        elif isinstance(value, Mapping):
            for k in sorted(value, key=str):
                walk(value[k], f"{path}.{k}")
        elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
            for i, v in enumerate(value):
                walk(v, f"{path}[{i}]")
        elif (fields := _cache_fields(value)) is not None:  # a key/value cache: its layers' tensors
            walk(fields, path)

    walk(obj, "")
    return out


def summaries_close(recorded: list | None, now: list, rtol: float = SUMMARY_RTOL) -> str | None:
    """``None`` when two summaries (``summarize_tensors``) agree within ``rtol``, else a short
    description of the first difference.

    Sums are compared relative to the leaf's scale (``sqrt(numel * sum of squares)``, a bound of
    |sum|), so a sum that is near zero by cancellation is not over-sensitive. The position-weighted
    sum is compared relative to the leaf's L2 norm (its typical size): last-bit differences move it
    by ~1e-7 of the norm, two swapped rows of ``m`` elements out of ``n`` by about
    ``sqrt(2m/n)`` of it. A row of another length (a summary of an older layout) is a difference.
    """
    if recorded is None:
        return "no summary recorded"
    if len(recorded) != len(now):
        return f"{len(recorded)} tensors recorded, {len(now)} now"
    for row_a, row_b in zip(recorded, now):
        if len(row_a) != 6 or len(row_b) != 6:
            return f"summary of {row_a[0] if row_a else '?'} has an unknown layout; re-record"
        (name_a, n_a, s_a, q_a, m_a, p_a), (name_b, n_b, s_b, q_b, m_b, p_b) = row_a, row_b
        if name_a != name_b or n_a != n_b:
            return f"tensor {name_a or '<input>'} ({n_a} elements) vs {name_b or '<input>'} ({n_b} elements)"
        scale = math.sqrt(max(n_a, 1) * max(q_a, q_b)) or 1.0
        norm = math.sqrt(max(q_a, q_b)) or 1.0
        for label, a, b, ref in (("sum", s_a, s_b, scale), ("sum of squares", q_a, q_b, max(q_a, q_b) or 1.0),
                                 ("max |x|", m_a, m_b, max(m_a, m_b) or 1.0),
                                 ("position-weighted sum (the order of its values)", p_a, p_b, norm)):
            if abs(a - b) > rtol * ref:
                return f"{label} of {name_a or '<input>'} differs: recorded {a:.9g}, now {b:.9g}"
    return None
