"""``kept_state``: buffers and generator attributes as they were on entry, whatever the block did."""
from __future__ import annotations

import pytest
import torch

from pytest_npu_parity.runtime.golden_run import GoldenRunner
from pytest_npu_parity.runtime.module_state import kept_state


class Stateful(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Module()
        self.inner.register_buffer("count", torch.zeros(2))
        self.inner.gen = torch.Generator().manual_seed(3)
        self.register_buffer("cache", torch.arange(4.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inner.count += 1
        self.cache.resize_(2)
        return x + self.inner.count.sum() + torch.rand(1, generator=self.inner.gen)


def test_buffers_and_generators_are_restored_also_on_error():
    m = Stateful().eval()
    count, cache, state = m.inner.count, m.cache, m.inner.gen.get_state()
    with pytest.raises(ZeroDivisionError), kept_state(m):
        m(torch.zeros(1))
        m.cache = torch.ones(9)  # a buffer replaced
        1 / 0
    assert m.inner.count is count and torch.equal(count, torch.zeros(2))
    assert m.cache is cache and torch.equal(cache, torch.arange(4.0))  # resized in place, then replaced
    assert torch.equal(m.inner.gen.get_state(), state)


def test_a_module_in_training_mode_is_left_alone():
    m = Stateful().train()
    with kept_state(m):
        m(torch.zeros(1))
    assert torch.equal(m.inner.count, torch.ones(2))  # the session gives such modules fresh copies


def test_inference_tensor_buffers_are_skipped():
    m = Stateful().eval()
    with torch.inference_mode():
        m.register_buffer("table", torch.ones(3))
    with kept_state(m):
        m(torch.zeros(1))
    assert torch.equal(m.inner.count, torch.zeros(2))


def test_each_golden_run_of_a_cached_copy_starts_from_the_same_state():
    runner = GoldenRunner()
    m = Stateful().eval()
    m.cache = torch.arange(2.0)  # already the size the forward resizes it to
    first = runner.run(m, (torch.zeros(1),))
    second = runner.run(m, (torch.zeros(1),))
    assert torch.equal(first[""], second[""])
    assert torch.equal(m.inner.count, torch.zeros(2))
