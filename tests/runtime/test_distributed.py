"""Data-parallel parity (``pytest_npu_parity.distributed``): sharding, rank devices, the reference, and
2-rank gloo DDP launches of the tiny Aurora (healthy, one rank's gradient scaled, a failing and a hung rank).

The launches spawn processes that import this module to find the model, loss and optimizer callables,
so those live at module level.
"""
from __future__ import annotations

import functools
import os
import time

import pytest
import torch

from pytest_npu_parity import distributed
from pytest_npu_parity.compare import compare
from pytest_npu_parity.policy import default_for_recipe

FP32 = default_for_recipe("fp32")


# -- module-level callables (importable by the spawned ranks) ----------------------------------

class Regression(torch.nn.Module):
    """A loss that is a mean of independent per-sample terms: no batch coupling, no randomness."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 1)

    def forward(self, x, y):
        return ((self.lin(x).squeeze(-1) - y) ** 2).mean()


class Coupled(Regression):
    """The same with a training-mode BatchNorm: the loss of a sample depends on its batch."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(6)

    def forward(self, x, y):
        return ((self.lin(self.norm(x)).squeeze(-1) - y) ** 2).mean()


def regression() -> torch.nn.Module:
    torch.manual_seed(0)
    return Regression()


def coupled() -> torch.nn.Module:
    torch.manual_seed(0)
    return Coupled()


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def loss_failing_on_rank_1(output):
    if os.environ.get("RANK") == "1":
        raise RuntimeError("rank 1 lost its loss")
    return output


def loss_hanging_on_rank_1(output):
    if os.environ.get("RANK") == "1":
        time.sleep(120)  # past the launcher's timeout; if the kill failed the test fails (no error)
    return output


def _regression_batch(n: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"x": torch.randn(n, 6, generator=g), "y": torch.randn(n, generator=g)}


def _tiny_aurora():
    from pytest_npu_parity.aurora import factory

    return functools.partial(factory.get_model, "tiny", seed=0)


def _aurora_inputs():
    from pytest_npu_parity.aurora import checks

    return checks.suite_batch().forward_kwargs(checks.HORIZON, train=True)


# -- sharding and devices ----------------------------------------------------------------------

def test_shard_inputs_gives_each_rank_its_contiguous_rows():
    batch = {"x": torch.arange(12.0).reshape(4, 3), "ids": torch.arange(4)}
    shards = [distributed.shard_inputs(batch, r, 2) for r in range(2)]
    assert torch.equal(shards[0]["x"], batch["x"][:2]) and torch.equal(shards[1]["x"], batch["x"][2:])
    assert shards[1]["ids"].tolist() == [2, 3]
    assert torch.equal(torch.cat([s["x"] for s in shards]), batch["x"])


@pytest.mark.parametrize("inputs, rank, world, error, text", [
    ({"x": torch.ones(3, 2)}, 0, 2, ValueError, "batch size 3 is not a multiple of world_size 2"),
    ({"x": torch.ones(4), "y": torch.ones(2)}, 0, 2, ValueError, "different batch sizes"),
    ({"x": torch.ones(4), "n": 3}, 0, 2, TypeError, "input 'n' is a int, not a tensor"),
    ({"x": torch.tensor(1.0)}, 0, 1, ValueError, "input 'x' is a 0-d tensor"),
    ({"x": torch.ones(4)}, 2, 2, ValueError, "rank must be an int in [0, 2)"),
    ({"x": torch.ones(4)}, 0, 0, ValueError, "world_size must be an int >= 1"),
    ({}, 0, 1, ValueError, "inputs is empty"),
])
def test_shard_inputs_rejects_what_cannot_be_split_evenly(inputs, rank, world, error, text):
    with pytest.raises(error, match=text.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        distributed.shard_inputs(inputs, rank, world)


def test_rank_devices_put_every_rank_on_its_own_accelerator():
    assert distributed.rank_devices("cpu", 2) == [torch.device("cpu")] * 2
    assert distributed.rank_devices(torch.device("cuda", 3), 2, device_count=8) == [
        torch.device("cuda", 3), torch.device("cuda", 4)]
    assert distributed.rank_devices(torch.device("cuda", 7), 2, device_count=8) == [
        torch.device("cuda", 7), torch.device("cuda", 0)]
    assert distributed.rank_devices("cuda", 2, device_count=2) == [torch.device("cuda", 0), torch.device("cuda", 1)]
    with pytest.raises(distributed.NotEnoughDevicesError, match="needs 2 cuda devices, 1 visible"):
        distributed.rank_devices("cuda:0", 2, device_count=1)
    with pytest.raises(ValueError, match="device type 'meta'"):
        distributed.rank_devices("meta", 2)


def test_free_port_is_bindable():
    import socket

    port = distributed.free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


# -- the reference -----------------------------------------------------------------------------

def _full_batch_step(factory, batch, optimizer_fn):
    model = factory().train()
    loss = model(**batch)
    loss.backward()
    grads = {f"grad.{n}": p.grad.clone() for n, p in model.named_parameters()}
    torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
    optimizer_fn(list(model.parameters())).step()
    return grads, {f"param.{n}": p.detach().clone() for n, p in model.named_parameters()}


def test_reference_of_a_per_sample_mean_loss_equals_the_full_batch_step():
    module, batch = regression(), _regression_batch()
    ref = distributed.reference_step(module, batch, world_size=2, optimizer_fn=sgd)
    grads, params = _full_batch_step(regression, batch, sgd)
    for rank in (0, 1):
        for key, value in {**grads, **params}.items():
            torch.testing.assert_close(ref[f"rank{rank}.{key}"], value, rtol=1e-6, atol=1e-7)
    # The per-rank losses are those of the halves; their mean is the full-batch loss.
    torch.testing.assert_close((ref["rank0.loss"] + ref["rank1.loss"]) / 2, module(**batch).detach())
    assert not torch.equal(ref["rank0.loss"], ref["rank1.loss"])


def test_reference_with_batchnorm_is_not_the_full_batch_step():
    # Why the reference averages per-shard gradients: training-mode BatchNorm normalizes with the
    # statistics of the shard, so no split step equals the full-batch step (SyncBatchNorm would).
    module, batch = coupled(), _regression_batch()
    ref = distributed.reference_step(module, batch, world_size=2, optimizer_fn=sgd)
    grads, _ = _full_batch_step(coupled, batch, sgd)
    diff = (ref["rank0.grad.lin.weight"] - grads["grad.lin.weight"]).abs().max().item()
    assert diff > 1e-3
    # Each rank's BatchNorm buffers follow its own shard.
    assert not torch.equal(ref["rank0.buffer.norm.running_mean"], ref["rank1.buffer.norm.running_mean"])


def test_reference_rejects_an_unknown_recipe():
    with pytest.raises(ValueError, match="unknown recipe 'fp8'"):
        distributed.reference_step(regression(), _regression_batch(), world_size=2, recipe="fp8")


# -- 2-rank gloo launches ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def aurora_ddp():
    """One healthy and one faulty 2-rank launch of the tiny Aurora (≈ 10–25 s each on 2 CPU cores)."""
    inputs = _aurora_inputs()
    healthy = distributed.data_parallel_step(_tiny_aurora(), inputs, world_size=2, seed=0, timeout_s=240)
    scaled = distributed.data_parallel_step(_tiny_aurora(), inputs, world_size=2, seed=0, timeout_s=240,
                                            grad_scales={1: 1 + 1e-3})
    return healthy, scaled


def test_two_gloo_ranks_reproduce_the_reference_step_of_aurora(aurora_ddp):
    result, _ = aurora_ddp
    assert result.backend == "gloo" and result.devices == ("cpu", "cpu") and result.world_size == 2
    assert set(result.actual) == set(result.expected)
    outcome = compare(result.actual, result.expected, FP32, name="ddp")
    assert outcome.passed, outcome.format("2-rank gloo DDP vs reference")
    n_params = sum(1 for k in result.expected if k.startswith("rank0.param."))
    assert n_params > 200 and any(k.startswith("rank1.buffer.") and "running_mean" in k for k in result.expected)
    # Upstream leaves some trainable parameters unused: DDP (find_unused_parameters) and the reference
    # agree that their gradient is None; every other gradient was all-reduced.
    unused = sorted(k for k, v in result.expected.items() if v is None)
    assert unused and unused == sorted(k for k, v in result.actual.items() if v is None)
    # Both ranks hold the same all-reduced gradients, but each rank's own loss.
    assert torch.equal(result.actual["rank0.grad.model.W"], result.actual["rank1.grad.model.W"])
    assert not torch.equal(result.actual["rank0.loss"], result.actual["rank1.loss"])


def test_a_rank_with_a_scaled_gradient_fails_the_check(aurora_ddp):
    _, result = aurora_ddp
    outcome = compare(result.actual, result.expected, FP32, name="ddp")
    assert not outcome.passed
    failing = [leaf.path for leaf in outcome.leaves if not leaf.passed]
    # The fault is in the all-reduce: every rank's averaged gradients are off, the local losses are not.
    assert any(p.startswith("rank0.grad.") for p in failing) and any(p.startswith("rank1.grad.") for p in failing)
    assert not any(p.endswith(".loss") for p in failing)
    # (g0 + 1.001·g1) / 2 vs (g0 + g1) / 2: a relative change of up to 5e-4, far above fp32's rtol 1.3e-6.
    worst = max(leaf.rel_l2 or 0.0 for leaf in outcome.leaves if not leaf.passed)
    assert worst > 1e-5


def test_a_failing_rank_is_reported_with_its_error():
    with pytest.raises(distributed.DataParallelError, match=r"rank 1 failed:[\s\S]*rank 1 lost its loss"):
        distributed.data_parallel_step(regression, _regression_batch(), world_size=2, optimizer_fn=sgd,
                                       loss_fn=loss_failing_on_rank_1, timeout_s=120)


def test_a_hung_rank_is_killed_after_the_timeout():
    start = time.monotonic()
    with pytest.raises(distributed.DataParallelError, match="did not finish within 15 s"):
        distributed.data_parallel_step(regression, _regression_batch(), world_size=2, optimizer_fn=sgd,
                                       loss_fn=loss_hanging_on_rank_1, timeout_s=15)
    assert time.monotonic() - start < 60


def test_launch_arguments_are_checked_before_anything_is_spawned():
    with pytest.raises(ValueError, match="not a multiple of world_size 2"):
        distributed.data_parallel_step(regression, _regression_batch(7), world_size=2)
    with pytest.raises(ValueError, match="unknown recipe"):
        distributed.data_parallel_step(regression, _regression_batch(), world_size=2, recipe="fp8")
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        distributed.data_parallel_step(regression, _regression_batch(), world_size=2, timeout_s=0)
    with pytest.raises(ValueError, match="the data-parallel step has no fp16 recipe: it would need a GradScaler"):
        distributed.data_parallel_step(regression, _regression_batch(), world_size=2, recipe="fp16")
    with pytest.raises(ValueError, match="no fp16 recipe"):
        distributed.reference_step(torch.nn.Linear(2, 1), {"x": torch.ones(2, 2)}, world_size=2, recipe="fp16")
