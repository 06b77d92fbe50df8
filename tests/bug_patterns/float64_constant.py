"""A float64 constant from NumPy reaching the target (NPUs have no fp64; it is downcast silently)."""
import numpy as np
import torch
from torch import nn


class Buggy(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        window = torch.as_tensor(np.hanning(x.shape[-1]), device=x.device)  # BUG
        return x * window


class Fixed(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        window = torch.hann_window(x.shape[-1], periodic=False, dtype=x.dtype, device=x.device)
        return x * window


def make_input() -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, 16).reshape(2, 8)
