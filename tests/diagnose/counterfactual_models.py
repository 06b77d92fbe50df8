"""Small models for the counterfactual and precision-island tests (tests/diagnose/test_counterfactual.py)."""
from __future__ import annotations

import contextlib

import torch

from pytest_npu_parity.diagnose.selfcheck import scaled_parameter


class Block(torch.nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.a = torch.nn.Linear(width, width)
        self.b = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.a(x)))


class Net(torch.nn.Module):
    """Four residual blocks and a head (fp32 allclose faults)."""

    def __init__(self, depth: int = 4, width: int = 8):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(width) for _ in range(depth)])
        self.head = torch.nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def net() -> Net:
    torch.manual_seed(0)
    return Net().eval()


def net_input() -> torch.Tensor:
    return torch.randn(5, 8, generator=torch.Generator().manual_seed(1))


def scaled(module: torch.nn.Module, name: str, factor: float):
    """A patch factory scaling ``module``'s parameter ``name`` on the target side (restored bit-exactly)."""
    return lambda device: scaled_parameter(module, name, factor)


class Moments(torch.nn.Module):
    """Normalizes its input by its mean and variance over the last axis, computed in float32. The
    target's port of the block with ``index == FRAGILE.index`` (while ``FRAGILE.on``) computes the
    moments with matmuls instead (E[h²] − E[h]²): autocast runs matmuls in bf16, and with |mean| ≈ 20
    and a variance of order 1 the subtraction cancels catastrophically (bf16 spacing at 400 is 2)."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if FRAGILE.on and self.index == FRAGILE.index:
            ones = torch.full((h.shape[-1], 1), 1.0 / h.shape[-1], dtype=h.dtype, device=h.device)
            mean = torch.matmul(h, ones)
            var = torch.matmul(h * h, ones) - mean * mean
        else:
            hf = h.float()
            mean = hf.mean(-1, keepdim=True)
            var = hf.var(-1, keepdim=True, unbiased=False)
        return (h - mean) / torch.sqrt(var.clamp_min(0) + 1e-5)


class _Fragile:
    on = False
    index = 1


FRAGILE = _Fragile()


class NormBlock(torch.nn.Module):
    def __init__(self, width: int, index: int):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)
        self.norm = Moments(index)
        with torch.no_grad():
            self.lin.bias.fill_(20.0)  # a large mean: E[h²] − E[h]² cancels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x))


class NormNet(torch.nn.Module):
    """embed -> two NormBlocks (lin, norm) -> head; bf16 golden-verdict tests."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.embed = torch.nn.Linear(width, width)
        self.blocks = torch.nn.ModuleList([NormBlock(width, i) for i in range(2)])
        self.head = torch.nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def norm_net() -> NormNet:
    torch.manual_seed(0)
    return NormNet().eval()


def norm_input() -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(1))


@contextlib.contextmanager
def fragile_moments(device):
    """The patch set of the bf16 tests: block ``FRAGILE.index``'s moments computed with matmuls."""
    FRAGILE.on = True
    try:
        yield
    finally:
        FRAGILE.on = False
