"""An op the target lacks, run on the target: ``torch.linalg.pinv`` (the Aurora→Ascend guide runs
Aurora's pinv on the CPU, §5.2). ``ManualFallback`` is the usual workaround done per forward."""
import torch
from torch import nn

#: What the audit is told the target lacks (the name as dispatched, without overload).
UNSUPPORTED_OPS = ("aten::linalg_pinv",)


def _weight() -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, 24).reshape(6, 4) + torch.eye(6, 4)


class Buggy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(_weight())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ torch.linalg.pinv(self.weight).T  # BUG


class ManualFallback(Buggy):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ torch.linalg.pinv(self.weight.cpu()).to(x.device).T  # BUG


class Fixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("weight_pinv", torch.linalg.pinv(_weight()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight_pinv.T


def make_input() -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, 18).reshape(3, 6)
