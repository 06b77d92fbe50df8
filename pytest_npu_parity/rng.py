"""Identical randomness on the reference and the target.

Device random streams differ between devices for the same seed (PyTorch's RNGs are per device and
per backend, by design), so a check that draws dropout masks or noise on the device can never match.
Inside ``same_randomness(seed)``:

* Python ``random``, NumPy's global state and torch's CPU generator are seeded with ``seed``;
* every draw made through ``torch.rand``, ``torch.randn``, ``torch.rand_like``, ``torch.randn_like``,
  ``torch.randint`` and ``torch.nn.functional.dropout`` (what ``nn.Dropout`` calls) is taken from one
  seeded CPU ``torch.Generator`` and then moved to the requested device and dtype;
* ``torch.nn.functional.scaled_dot_product_attention`` with ``dropout_p > 0`` (what
  ``nn.MultiheadAttention`` uses in training) is computed by its reference formula — softmax(QKᵀ·scale
  + mask) with a CPU-drawn dropout mask, then ·V — instead of the fused kernel's device RNG.

So both sides see the same numbers in the same order. The replacements are installed on entry and
the originals restored on exit; the scope is meant to wrap one run of one check (not thread-safe).
"""
from __future__ import annotations

import contextlib
import math
import random
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F

_ORIGINALS = {
    (torch, "rand"): torch.rand,
    (torch, "randn"): torch.randn,
    (torch, "rand_like"): torch.rand_like,
    (torch, "randn_like"): torch.randn_like,
    (torch, "randint"): torch.randint,
    (F, "dropout"): F.dropout,
    (F, "scaled_dot_product_attention"): F.scaled_dot_product_attention,
}


def _split_size(args: tuple) -> tuple[tuple[int, ...], tuple]:
    if args and isinstance(args[0], (tuple, list, torch.Size)):
        return tuple(args[0]), args[1:]
    sizes = []
    rest = list(args)
    while rest and isinstance(rest[0], int):
        sizes.append(rest.pop(0))
    return tuple(sizes), tuple(rest)


class _CpuDraws:
    """Random functions that draw on the CPU from one generator and move the result."""

    def __init__(self, seed: int):
        self.gen = torch.Generator(device="cpu")
        self.gen.manual_seed(seed)

    @staticmethod
    def _place(t: torch.Tensor, device, dtype, requires_grad=False) -> torch.Tensor:
        t = t.to(device=device if device is not None else "cpu", dtype=dtype if dtype is not None else t.dtype)
        return t.requires_grad_(requires_grad) if requires_grad else t

    def _factory(self, draw):
        def fn(*args, dtype=None, device=None, requires_grad=False, generator=None, **kwargs):
            size, _ = _split_size(args)
            sample = draw(size, generator=generator or self.gen, dtype=torch.float32)
            return self._place(sample, device, dtype or torch.get_default_dtype(), requires_grad)
        return fn

    def rand(self, *args, **kwargs):
        return self._factory(_ORIGINALS[(torch, "rand")])(*args, **kwargs)

    def randn(self, *args, **kwargs):
        return self._factory(_ORIGINALS[(torch, "randn")])(*args, **kwargs)

    def _like(self, draw, x, dtype=None, device=None, requires_grad=False, **kwargs):
        sample = draw(tuple(x.shape), generator=self.gen, dtype=torch.float32)
        return self._place(sample, device or x.device, dtype or x.dtype, requires_grad)

    def rand_like(self, x, **kwargs):
        return self._like(_ORIGINALS[(torch, "rand")], x, **kwargs)

    def randn_like(self, x, **kwargs):
        return self._like(_ORIGINALS[(torch, "randn")], x, **kwargs)

    def randint(self, *args, dtype=None, device=None, generator=None, requires_grad=False, **kwargs):
        # torch.randint(high, size) or torch.randint(low, high, size)
        if len(args) == 2:
            low, high, size = 0, args[0], args[1]
        else:
            low, high, size = args[0], args[1], args[2]
        sample = _ORIGINALS[(torch, "randint")](low, high, tuple(size), generator=generator or self.gen)
        return self._place(sample, device, dtype or torch.int64)

    def dropout_mask(self, shape, p: float, device, dtype) -> torch.Tensor:
        keep = _ORIGINALS[(torch, "rand")](tuple(shape), generator=self.gen) >= p
        return (keep.to(dtype=dtype) / (1.0 - p)).to(device)

    def dropout(self, input, p=0.5, training=True, inplace=False):
        if not training or p == 0.0:
            return input
        if p == 1.0:
            return input.mul_(0) if inplace else input * 0
        mask = self.dropout_mask(input.shape, p, input.device, input.dtype)
        return input.mul_(mask) if inplace else input * mask

    def sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
        if dropout_p == 0.0:
            return _ORIGINALS[(F, "scaled_dot_product_attention")](
                query, key, value, attn_mask=attn_mask, dropout_p=0.0, is_causal=is_causal, scale=scale, **kwargs)
        # Reference formula of F.scaled_dot_product_attention (PyTorch docs), with a CPU-drawn mask.
        L, S = query.size(-2), key.size(-2)
        scale_factor = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
        scores = query @ key.transpose(-2, -1) * scale_factor
        if is_causal:
            causal = torch.ones(L, S, dtype=torch.bool, device=query.device).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                scores = scores.masked_fill(~attn_mask, float("-inf"))
            else:
                scores = scores + attn_mask
        weights = torch.softmax(scores, dim=-1)
        weights = self.dropout(weights, p=dropout_p, training=True)
        return weights @ value


def seed_everything(seed: int) -> None:
    """Seed Python ``random``, NumPy's global RNG and torch (CPU and every device) with ``seed``."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


@contextlib.contextmanager
def same_randomness(seed: int = 0) -> Iterator[None]:
    """Make every random draw inside the block come from a seeded CPU stream (see module doc).

    Args:
        seed: the seed; the reference and target runs of one check must use the same one.
    """
    draws = _CpuDraws(seed)
    replacements = {
        (torch, "rand"): draws.rand,
        (torch, "randn"): draws.randn,
        (torch, "rand_like"): draws.rand_like,
        (torch, "randn_like"): draws.randn_like,
        (torch, "randint"): draws.randint,
        (F, "dropout"): draws.dropout,
        (F, "scaled_dot_product_attention"): draws.sdpa,
    }
    py_state, np_state, torch_state = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    seed_everything(seed)
    try:
        for (owner, name), fn in replacements.items():
            setattr(owner, name, fn)
        yield
    finally:
        for (owner, name), fn in _ORIGINALS.items():
            setattr(owner, name, fn)
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.random.set_rng_state(torch_state)
