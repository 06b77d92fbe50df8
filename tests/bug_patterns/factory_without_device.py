"""A constant built with a factory call without ``device=`` and mixed with an input.

On a real target the add raises "Expected all tensors to be on the same device"; the tensor from
``torch.arange``/``torch.ones`` lives on the CPU because the factory was not told otherwise.
"""
import torch
from torch import nn


class BuggyArange(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.arange(x.shape[-1], dtype=x.dtype)  # BUG


class BuggyOnes(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.ones(x.shape[-1])  # BUG


class Fixed(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[-1], dtype=x.dtype, device=x.device)
        return (x + positions) * torch.ones(x.shape[-1], device=x.device)


def make_input() -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, 12).reshape(3, 4)
