"""runtime.distributed_trajectory: N DDP steps on 2 gloo ranks against the single-process reference, judged by curves.

A rank whose gradient buckets are scaled before every all-reduce (a broken collective) must part the curves; the
healthy launch must reproduce the reference.
"""
import functools

import pytest
import torch

from pytest_npu_parity.aurora import checks, factory
from pytest_npu_parity.judge.allclose import ParityError
from pytest_npu_parity.judge.trajectory import DEFAULT_LIMITS, judge_trajectory
from pytest_npu_parity.runner import ParityCase, ParitySession
from pytest_npu_parity.runtime.distributed_trajectory import data_parallel_trajectory, reference_trajectory
from pytest_npu_parity.runtime.trajectory import TrajectoryLoop

LOOP = TrajectoryLoop(steps=8)
TINY = functools.partial(factory.get_model, "tiny", seed=0)


@pytest.fixture(scope="module")
def launches():
    """A healthy and a faulty 2-rank launch of 8 steps (each ≈ 15–40 s on 2 CPU cores)."""
    batches = checks.trajectory_batches()
    healthy = data_parallel_trajectory(TINY, batches, LOOP, world_size=2, timeout_s=300)
    faulty = data_parallel_trajectory(TINY, batches, LOOP, world_size=2, timeout_s=300, grad_scales={1: 1 + 1e-3})
    return healthy, faulty


def test_two_gloo_ranks_reproduce_the_reference_curves(launches):
    healthy, _ = launches
    assert healthy.backend == "gloo" and healthy.devices == ("cpu", "cpu")
    assert healthy.actual["loss"].shape == (8,) and not torch.equal(healthy.actual["rank0.loss"],
                                                                     healthy.actual["rank1.loss"])
    result = judge_trajectory(healthy.actual, healthy.expected, DEFAULT_LIMITS["fp32"])
    assert result.passed and result.mean_rel_loss_error < 1e-7, result.format()


def test_a_rank_with_wrong_gradients_parts_the_curves_at_the_step_after_the_first(launches):
    _, faulty = launches
    case = ParityCase(ParitySession(torch.device("cpu"), reference="cpu"), "tests/t.py::t", "fp32")
    with pytest.raises(ParityError) as failure:
        case.compare_trajectory("ddp", faulty.actual, faulty.expected)
    result = failure.value.result
    # step 0's loss is computed before any update; the scaled all-reduce shows in step 0's grad norm
    assert result.grad_norm_parted_at == 0 and result.loss_parted_at is not None and result.loss_parted_at >= 1
    assert case.records[0].policy == "trajectory"


def test_the_reference_is_the_averaged_gradient_step():
    # one rank: the reference is the plain single-process training loop's curves
    model = TINY()
    batches = checks.trajectory_batches()
    ref = reference_trajectory(model, batches[:2], TrajectoryLoop(steps=2), world_size=1)
    assert ref["loss"].shape == (2,) and torch.equal(ref["loss"], ref["rank0.loss"])
    assert float(ref["grad_norm"][0]) > 0 and ref["lr"].tolist() == [1e-4, 1e-4]


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="no batches"):
        data_parallel_trajectory(TINY, [], LOOP)
    with pytest.raises(ValueError, match="fp16"):
        data_parallel_trajectory(TINY, checks.trajectory_batches(), LOOP, recipe="fp16")
