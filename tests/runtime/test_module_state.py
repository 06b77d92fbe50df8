"""``kept_state``: buffers, attributes and generator attributes as they were on entry, whatever the block did."""
from __future__ import annotations

import functools

import pytest
import torch

from pytest_npu_parity.runtime.golden_run import GoldenRunner
from pytest_npu_parity.runtime.module_state import kept_state, state_owners


class Stateful(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Module()
        self.inner.register_buffer("count", torch.zeros(2))
        self.inner.gen = torch.Generator().manual_seed(3)
        self.register_buffer("cache", torch.arange(4.0))
        self.register_buffer("lazy", None)
        self.acc = torch.zeros(1)  # a plain tensor attribute
        self.n = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inner.count += 1
        self.cache.resize_(2)
        self.acc.data += 1  # through .data: no version counter sees it
        self.n += 1
        if self.lazy is None:
            self.lazy = x.clone()
        self.filled = True
        return x + self.inner.count.sum() + torch.rand(1, generator=self.inner.gen)


def test_buffers_attributes_and_generators_are_put_back_also_on_error():
    m = Stateful().eval()
    count, state = m.inner.count, m.inner.gen.get_state()
    with pytest.raises(ZeroDivisionError), kept_state(m):
        out = m(torch.zeros(1))
        m.register_buffer("extra", torch.ones(1))
        1 / 0
    assert m.inner.count is count and torch.equal(count, torch.zeros(2))  # the same tensor, its values copied back
    assert torch.equal(m.cache, torch.arange(4.0)) and torch.equal(m.acc, torch.zeros(1))
    assert m.n == 0 and m.lazy is None and not hasattr(m, "filled") and "extra" not in m._buffers
    assert torch.equal(m.inner.gen.get_state(), state)
    assert 2.0 <= float(out) < 3.0  # the output kept what the run computed (count 1 + 1, plus a draw in [0, 1))


def test_an_output_that_is_a_buffer_keeps_the_runs_values():
    class Total(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("total", torch.ones(3))

        def forward(self, x):
            self.total.add_(x)
            return self.total

    m = Total().eval()
    with kept_state(m) as kept:
        out = m(torch.full((3,), 2.0))
        leaf = kept.detach_output(out)
        view = kept.detach_output(out[:2])
    assert torch.equal(leaf, torch.full((3,), 3.0)) and torch.equal(view, torch.full((2,), 3.0))
    assert torch.equal(m.total, torch.ones(3))


def test_a_buffer_shared_by_two_submodules_stays_shared():
    m = torch.nn.Sequential(torch.nn.Module(), torch.nn.Module()).eval()
    shared = torch.zeros(2)
    m[0].register_buffer("t", shared)
    m[1].register_buffer("t", shared)
    with kept_state(m):
        m[0].t.add_(1)
    assert m[0].t is m[1].t and torch.equal(m[1].t, torch.zeros(2))


def test_a_module_in_training_mode_is_put_back_too():
    m = Stateful().train()  # (a module the session is given in training mode runs on a fresh copy; one a function closes over does not)
    with kept_state(m):
        m(torch.zeros(1))
    assert torch.equal(m.inner.count, torch.zeros(2)) and m.n == 0


def test_views_and_buffers_shared_between_modules_stay_views_and_shared():
    class Cache(torch.nn.Module):
        def __init__(self, acc: torch.Tensor) -> None:
            super().__init__()
            self.register_buffer("acc", acc)
            self.head = self.acc[:2]  # a plain attribute viewing the buffer
            self.register_buffer("tail", self.acc[2:])

    shared = torch.zeros(4)
    enc, dec = Cache(shared), Cache(shared)
    with kept_state(enc, dec):
        enc.acc.add_(1)
    assert enc.acc is dec.acc is shared and torch.equal(shared, torch.zeros(4))
    shared.add_(5)  # still views of the one storage
    assert torch.equal(enc.head, torch.full((2,), 5.0)) and torch.equal(dec.tail, torch.full((2,), 5.0))


def test_an_attribute_that_became_a_tensor_between_runs_is_put_back():
    class Pos(torch.nn.Module):
        def forward(self, x):
            self.pos += 1
            return x + self.pos

    m = Pos().eval()
    m.pos = 0
    with kept_state(m):
        m(torch.zeros(1))
    assert m.pos == 0
    m.pos = torch.tensor(0.0)  # equal to the int before, but a tensor changed in place
    with kept_state(m):
        m(torch.zeros(1))
    assert float(m.pos) == 0.0
    m.pos = 1.0
    with kept_state(m):
        m(torch.zeros(1))
    assert m.pos == 1.0


def test_inference_tensor_buffers_are_skipped():
    m = Stateful().eval()
    with torch.inference_mode():
        m.register_buffer("table", torch.ones(3))
    with kept_state(m):
        m(torch.zeros(1))
    assert torch.equal(m.inner.count, torch.zeros(2))


def test_the_modules_a_function_closes_over_or_binds_are_found():
    a, b = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)

    def run(model, x):
        return model(x)

    assert state_owners(a) == [a] and state_owners(a.forward) == [a]
    assert state_owners(lambda x: a(x) + b(x)) == [a, b]
    assert state_owners(functools.partial(run, b)) == [b]
    assert state_owners(run) == []


def test_each_golden_run_of_a_cached_copy_starts_from_the_same_state():
    runner = GoldenRunner()
    m = Stateful().eval()
    m.cache = torch.arange(2.0)  # already the size the forward resizes it to
    first = runner.run(m, (torch.zeros(1),))
    second = runner.run(m, (torch.zeros(1),))
    assert torch.equal(first[""], second[""])
    assert torch.equal(m.inner.count, torch.zeros(2))
