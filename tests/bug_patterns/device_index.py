"""A hard-coded device index, ``.to(0)``, on a table kept as a plain attribute."""
import torch
from torch import nn


class Buggy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.linspace(0.5, 1.5, 6)  # not a buffer: module.to() leaves it behind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale.to(0)  # BUG


class Fixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def make_input() -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, 12).reshape(2, 6)
