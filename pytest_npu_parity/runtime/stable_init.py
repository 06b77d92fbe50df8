"""Seeded weights that are bitwise the same on every machine and every torch version.

A baseline recorded on one machine is only comparable with a run on another when both run the
*same model*. Weights "seeded" by ``torch.manual_seed`` and PyTorch's or Hugging Face's own
initializers are not: ``torch.nn.init.trunc_normal_`` changed its algorithm between torch 2.5.1
and 2.14.1 (same seed, different numbers; Hugging Face's ViT init uses it), and ``torch.randn``
on the CPU goes through vectorized Box-Muller code whose transcendental functions may round
differently on another ISA. This module draws every value from integer arithmetic alone:

1. a per-tensor key: the first 16 bytes of SHA-256 of ``f"{seed}:{name}"`` (``name`` is the
   ``state_dict`` key), as the seed of NumPy's ``PCG64`` bit generator; NumPy's bit generators
   (not its ``Generator`` distribution methods) are stream-stable across NumPy releases
   (NEP 19, "Random number generator policy");
2. ``PCG64.random_raw`` 64-bit words, read as little-endian uint32 pairs (one per element);
3. ``u = (w >> 8) · 2⁻²³ − 1``: the top 24 bits as a float32 in ``[−1, 1)``; every step is exact;
4. ``value = u · bound`` in float32: one IEEE-754 round-to-nearest multiplication.

Integer shifts, integer-to-float conversion of 24-bit values and a single float32 multiply are
exact or correctly rounded on every IEEE-754 machine, so the result does not depend on the CPU,
its SIMD width, the thread count, or the torch/NumPy version. ``tests/runtime/test_stable_init.py``
checks the values against an independent NumPy implementation of the same steps and against
known answers.

:func:`stable_init_` overwrites every floating ``state_dict`` tensor of a module (parameters and
persistent buffers such as BatchNorm statistics) by rules that depend only on its name, shape and
whether the module's own init made it a constant (a property of the model's code, not of the RNG):

* constant ``0`` (biases, zero-initialized layers such as DiT's adaLN modulation, BatchNorm
  ``running_mean``): uniform with std 0.02 for matrices (the Hugging Face ``initializer_range``
  and DiT init scale) and 0.1 for vectors, so no kernel's bias path goes unchecked and no output
  collapses to a constant (a dropped 0.1-std bias moves outputs by about 10 %);
* constant ``c ≠ 0`` (LayerNorm/BatchNorm scales): ``c · (1 + ε)``, ε uniform with std 0.1;
* BatchNorm ``running_var``: uniform on ``[0.5, 1.5]`` (positive, not the identity);
* anything else (random draws, ``torch.eye``, data-derived tables), matrices and higher:
  uniform on ``±1/sqrt(fan_in)`` — PyTorch's default ``nn.Linear``/``nn.Conv*`` bound
  (``kaiming_uniform_(a=sqrt(5))``), ``fan_in = shape[1] · prod(shape[2:])``;
  vectors: uniform with std 0.1.

A uniform distribution on ``±b`` has std ``b/sqrt(3)``; "uniform with std s" means ``b = s·sqrt(3)``.
"""
from __future__ import annotations

import hashlib
import math

import numpy as np
import torch

__all__ = ["stable_uniform", "stable_init_", "tensor_key", "MATRIX_STD", "VECTOR_STD", "RELATIVE_STD",
           "RUNNING_VAR_RANGE", "STABLE_MARK"]

#: Attribute set on every submodule :func:`stable_init_` initialized (its seed).
STABLE_MARK = "_npu_parity_stable_init"
#: std of a zero-initialized matrix's draw (Hugging Face ``initializer_range``).
MATRIX_STD = 0.02
#: std of a vector's draw (biases, non-constant vectors).
VECTOR_STD = 0.1
#: relative std around a non-zero constant init (norm scales).
RELATIVE_STD = 0.1
#: range of BatchNorm ``running_var``.
RUNNING_VAR_RANGE = (0.5, 1.5)

_SQRT3 = math.sqrt(3.0)


def tensor_key(seed: int, name: str) -> int:
    """The 128-bit PCG64 seed of tensor ``name`` under ``seed``: SHA-256 of ``f"{seed}:{name}"``, first 16 bytes.

    Raises:
        ValueError: ``seed`` is negative or not an int.
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"stable init: seed must be a non-negative int, got {seed!r}")
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:16], "little")


def stable_uniform(shape: tuple[int, ...] | torch.Size, seed: int, name: str, low: float = -1.0,
                   high: float = 1.0) -> torch.Tensor:
    """Float32 CPU tensor of ``shape``, uniform on ``[low, high)``, bitwise identical everywhere.

    Args:
        shape: output shape (any, including ``()`` and zero-sized).
        seed: non-negative int; with ``name`` it selects the stream (:func:`tensor_key`).
        name: the tensor's name (e.g. its ``state_dict`` key).
        low, high: the interval; computed as ``centre + u · half`` with ``u`` in ``[−1, 1)``
            (module docstring), ``centre`` and ``half`` rounded to float32 first.
    Returns:
        A contiguous float32 tensor on the CPU.
    Raises:
        ValueError: bad seed, or ``high <= low``.
    """
    if not high > low:
        raise ValueError(f"stable_uniform({name!r}): high ({high}) must exceed low ({low})")
    numel = math.prod(shape)
    words = np.random.PCG64(tensor_key(seed, name)).random_raw((numel + 1) // 2)
    bits = torch.from_numpy(words.astype("<u8", copy=False).view("<i4")[:numel].copy())
    u = torch.bitwise_right_shift(bits, 8).bitwise_and_(0xFFFFFF).to(torch.float32)
    u.mul_(2.0 ** -23).sub_(1.0)
    half = float(np.float32((high - low) / 2.0))
    centre = float(np.float32((high + low) / 2.0))
    u.mul_(half)
    if centre != 0.0:
        u.add_(centre)
    return u.reshape(tuple(shape))


def _fan_in(shape: torch.Size) -> int:
    receptive = math.prod(shape[2:]) if len(shape) > 2 else 1
    return max(1, int(shape[1]) * receptive)


def _constant_value(tensor: torch.Tensor) -> float | None:
    if tensor.numel() <= 1:
        return None
    flat = tensor.detach().reshape(-1)
    first = flat[0]
    return float(first) if bool((flat == first).all()) else None


def _draw(name: str, tensor: torch.Tensor, seed: int) -> torch.Tensor:
    shape = tensor.shape
    matrix = tensor.dim() >= 2
    if name.endswith("running_var"):
        return stable_uniform(shape, seed, name, *RUNNING_VAR_RANGE)
    constant = _constant_value(tensor)
    if constant is not None and constant != 0.0:
        eps = stable_uniform(shape, seed, name, -RELATIVE_STD * _SQRT3, RELATIVE_STD * _SQRT3)
        return eps.add_(1.0).mul_(constant)
    if constant == 0.0:
        bound = (MATRIX_STD if matrix else VECTOR_STD) * _SQRT3
    else:
        bound = 1.0 / math.sqrt(_fan_in(shape)) if matrix else VECTOR_STD * _SQRT3
    return stable_uniform(shape, seed, name, -bound, bound)


@torch.no_grad()
def stable_init_(module: torch.nn.Module, seed: int = 0) -> list[str]:
    """Overwrite every floating ``state_dict`` tensor of ``module`` with version-stable draws (in place).

    Rules in the module docstring. Each tensor has its own stream (seed and ``state_dict`` name),
    so the result does not depend on iteration order or on any global RNG, and two machines with
    any torch ≥ 2.5.1 produce bitwise-identical weights. Values are drawn in float32 and cast to
    the tensor's dtype and device; ``requires_grad`` is kept; integer buffers
    (``num_batches_tracked``, position ids) are left alone. Every submodule gets the attribute
    :data:`STABLE_MARK` (the seed): a baseline recording then stores no copy of these weights for replay
    on other machines (``checks.replay``), since they are the same there.

    Args:
        module: any module; tensors on any device, floating dtypes.
        seed: non-negative int.
    Returns:
        The names written, in ``state_dict`` order.
    Raises:
        ValueError: bad seed.
    """
    written: list[str] = []
    for name, tensor in module.state_dict(keep_vars=True).items():
        if not tensor.is_floating_point() or tensor.numel() == 0:
            continue
        tensor.data.copy_(_draw(name, tensor, seed).to(device=tensor.device, dtype=tensor.dtype))
        written.append(name)
    for sub in module.modules():  # recordings need not carry these weights (checks.replay)
        setattr(sub, STABLE_MARK, seed)
    return written
