"""Tests for pytest_npu_parity.stable_init: bitwise-stable seeded weights."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pytest_npu_parity import stable_init
from pytest_npu_parity.stable_init import stable_init_, stable_uniform, tensor_key


def _numpy_reference(shape, seed, name, low, high):
    """The module's algorithm written again in plain NumPy (uint32 arithmetic, float32 ops)."""
    n = math.prod(shape)
    words = np.random.PCG64(tensor_key(seed, name)).random_raw((n + 1) // 2)
    bits = words.astype("<u8").view("<u4")[:n]
    u = (bits >> np.uint32(8)).astype(np.float32) * np.float32(2.0 ** -23) - np.float32(1.0)
    half, centre = np.float32((high - low) / 2), np.float32((high + low) / 2)
    out = u * half
    if centre != 0:
        out = out + centre
    return out.reshape(shape)


@pytest.mark.parametrize("shape,low,high", [((7,), -1.0, 1.0), ((3, 5), -0.1, 0.1), ((2, 3, 4), 0.5, 1.5), ((), -1, 1),
                                            ((0, 4), -1, 1)])
def test_matches_an_independent_numpy_implementation(shape, low, high):
    got = stable_uniform(shape, 3, "layer.weight", low, high)
    assert got.dtype == torch.float32 and tuple(got.shape) == shape
    np.testing.assert_array_equal(got.numpy(), _numpy_reference(shape, 3, "layer.weight", low, high))


def test_known_answers():
    """The stream is part of every committed baseline: these values must never change."""
    got = stable_uniform((4,), 0, "w").tolist()
    assert got == _numpy_reference((4,), 0, "w", -1.0, 1.0).tolist()
    assert tensor_key(0, "w") == int.from_bytes(__import__("hashlib").sha256(b"0:w").digest()[:16], "little")
    assert [float(np.float32(x)) for x in got] == got
    # values on a 2^-23 grid in [-1, 1)
    assert all(-1.0 <= x < 1.0 and (x * 2 ** 23) == int(x * 2 ** 23) for x in got)


def test_range_and_moments():
    x = stable_uniform((200_000,), 1, "big", -2.0, 4.0)
    assert float(x.min()) >= -2.0 and float(x.max()) < 4.0
    assert abs(float(x.mean()) - 1.0) < 0.02 and abs(float(x.std()) - 6 / math.sqrt(12)) < 0.02


def test_streams_differ_by_seed_and_name():
    a = stable_uniform((64,), 0, "a")
    assert torch.equal(a, stable_uniform((64,), 0, "a"))
    assert not torch.equal(a, stable_uniform((64,), 1, "a"))
    assert not torch.equal(a, stable_uniform((64,), 0, "b"))


def test_does_not_touch_global_rngs():
    torch.manual_seed(5)
    np.random.seed(5)
    state, np_state = torch.get_rng_state(), np.random.get_state()[1].copy()
    stable_uniform((10,), 0, "x")
    assert torch.equal(torch.get_rng_state(), state) and np.array_equal(np.random.get_state()[1], np_state)


def test_bad_arguments():
    with pytest.raises(ValueError, match="seed"):
        tensor_key(-1, "x")
    with pytest.raises(ValueError, match="high"):
        stable_uniform((2,), 0, "x", 1.0, 1.0)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.eye = torch.nn.Parameter(torch.eye(4))
        self.emb = torch.nn.Embedding(10, 4).to(torch.float64)


def test_rules():
    net = _Net()
    torch.manual_seed(0)
    written = stable_init_(net, seed=0)
    sd = net.state_dict()
    assert written == [k for k, v in sd.items() if v.is_floating_point()]
    assert "bn.num_batches_tracked" not in written
    assert float(sd["lin.weight"].abs().max()) <= 1 / math.sqrt(16)  # PyTorch's default Linear bound
    assert 0.7 < float(sd["norm.weight"].min()) and float(sd["norm.weight"].max()) < 1.3  # 1 · (1 + ε)
    assert float(sd["norm.bias"].abs().max()) <= 0.1 * math.sqrt(3) + 1e-7 and float(sd["norm.bias"].abs().min()) > 0
    assert bool(((sd["bn.running_var"] >= 0.5) & (sd["bn.running_var"] < 1.5)).all())
    assert not torch.equal(sd["eye"], torch.eye(4))
    assert sd["emb.weight"].dtype == torch.float64  # dtype kept
    assert net.lin.weight.requires_grad


def test_independent_of_construction_rng():
    torch.manual_seed(0)
    a = _Net()
    torch.manual_seed(1)
    b = _Net()
    assert not torch.equal(a.lin.weight, b.lin.weight)
    stable_init_(a, 7)
    stable_init_(b, 7)
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, b.state_dict()[name]), name


def test_constants_are_read_from_the_module_code():
    """Zero and non-zero constants get their own rules; a 1-element tensor is never taken as one."""
    lin = torch.nn.Linear(3, 3)
    with torch.no_grad():
        lin.bias.fill_(2.0)
    stable_init_(lin, 0)
    assert 1.6 < float(lin.bias.detach().min()) and float(lin.bias.detach().max()) < 2.4
    assert stable_init._constant_value(torch.tensor([5.0])) is None
