"""Golden shims of the Aurora adapter: what a float64 golden run of aurora-model 0.2.0 needs changed.

``GoldenRunner`` (``pytest_npu_parity.golden``) runs a check's computation again on the CPU at a higher
precision; a model that hard-codes a float32 step cannot follow it there. The Aurora suite sets
``parity_session.golden_runner.shims = aurora_golden_shims`` (``parity_suites/aurora/conftest.py``);
the calibration harness (``benchmarks/calibration.py``) does the same.

Importing this module does not import ``aurora``: the shim imports it when entered.
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch

__all__ = ["aurora_golden_shims"]


@contextlib.contextmanager
def aurora_golden_shims(dtype: torch.dtype) -> Iterator[None]:
    """Golden shim for aurora-model 0.2.0: ``TimestepEmbedder.timestep_embedding`` builds its
    frequencies in float32 whatever the input; in a float64 golden run it is computed in float64
    instead — the sinusoidal timestep embedding of GLIDE/DiT that upstream cites:
    ``[cos(t·f_k), sin(t·f_k)]`` with ``f_k = exp(−ln(max_period)·k/half)``, ``k = 0…half−1``
    (plus a zero column for odd ``dim``). Other dtypes run upstream unchanged.

    Args:
        dtype: the golden run's dtype (``torch.float64`` patches; any other dtype changes nothing).

    Raises:
        ImportError: aurora-model is not installed.
    """
    # Imported here, not at the top: importing the adapter must not import aurora (module docstring).
    from aurora.flow_loss import TimestepEmbedder

    if dtype != torch.float64:
        yield
        return

    def timestep_embedding(t: torch.Tensor, dim: int, max_period: int = 10000) -> torch.Tensor:
        half = dim // 2
        k = torch.arange(half, dtype=torch.float64, device=t.device)
        freqs = torch.exp(k * (-math.log(max_period) / half))
        phase = t.to(torch.float64)[:, None] * freqs[None]
        parts = [torch.cos(phase), torch.sin(phase)]
        if dim % 2:
            parts.append(torch.zeros_like(phase[:, :1]))
        return torch.cat(parts, dim=-1)

    original = TimestepEmbedder.__dict__["timestep_embedding"]
    TimestepEmbedder.timestep_embedding = staticmethod(timestep_embedding)
    try:
        yield
    finally:
        TimestepEmbedder.timestep_embedding = original
