"""A hard-coded ``.cuda()``: the tensor goes to ``cuda:0`` whatever device the module runs on."""
import torch
from torch import nn


class Buggy(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(x).cuda()  # BUG
        return x * gate


class Fixed(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(x)
        return x * gate


def make_input() -> torch.Tensor:
    return torch.linspace(-2.0, 2.0, 10).reshape(2, 5)
