"""Data-parallel (DDP) training of the tiny Aurora on 2 ranks against a single-process reference: one step, and
a trajectory of 5 steps (300 in the nightly job) judged by its curves.

Parity of one process says nothing about the gradient all-reduce that DDP/DeepSpeed performs over HCCL.
Two ranks are spawned on the target's device type (gloo on the CPU, hccl on NPUs, nccl on CUDA; rank r
on device index target+r), each runs one training step on its half of the real CO2 batch under the
NPU patch set, and DDP all-reduces the gradients. The reference is the gradient-accumulation-equivalent
single process on the target: the same two half-batches with the same per-rank random streams, the
gradients averaged, then clipping and AdamW once (``distributed`` module docstring: why a full-batch step
cannot be the reference for Aurora — BatchNorm batch statistics, masked means, per-batch noise).

Compared under the training-step tolerances for every rank: loss, every all-reduced gradient, every
parameter after the step and every buffer. Nothing is stored as a baseline (the reference is live).
"""
import functools

import pytest

from pytest_npu_parity.runtime import distributed
from pytest_npu_parity.runtime.distributed_trajectory import data_parallel_trajectory
from pytest_npu_parity.runtime.trajectory import TrajectoryLoop
from pytest_npu_parity.aurora import checks, factory, patches

WORLD_SIZE = 2


def _skip_unless_runnable(parity, what):
    """Skip, saying why, a record run (the reference is live), a loss-scaling recipe and too few devices."""
    if parity.session.update_baselines:
        pytest.skip(f"the data-parallel {what} is judged against a live single-process reference; nothing to record")
    if parity.recipe.loss_scaling:
        pytest.skip(distributed.loss_scaling_unsupported(parity.recipe.name))
    try:
        distributed.rank_devices(parity.target, WORLD_SIZE)
    except distributed.NotEnoughDevicesError as exc:
        pytest.skip(str(exc))


def test_data_parallel_step(parity):
    _skip_unless_runnable(parity, "step")
    batch = checks.suite_batch()
    result = distributed.data_parallel_step(
        functools.partial(factory.get_model, "tiny", seed=0),  # cached per process (per xdist worker)
        batch.forward_kwargs(checks.HORIZON, train=True),
        world_size=WORLD_SIZE, device=parity.target, seed=parity.session.seed, recipe=parity.recipe.name,
        setup=patches.patched)
    parity.compare("data_parallel_step", result.actual, result.expected, group="data-parallel step")


#: The guide's smoke run (``NPROC_PER_NODE=2 … --max_steps 5``); the nightly job trains 300 steps.
SMOKE_STEPS, NIGHTLY_STEPS = 5, 300


def _data_parallel_trajectory(parity, steps):
    _skip_unless_runnable(parity, "trajectory")
    result = data_parallel_trajectory(
        functools.partial(factory.get_model, "tiny", seed=0), checks.trajectory_batches(), TrajectoryLoop(steps=steps),
        world_size=WORLD_SIZE, device=parity.target, seed=parity.session.seed, recipe=parity.recipe.name,
        setup=patches.patched)
    parity.compare_trajectory("data_parallel_trajectory", result.actual, result.expected,
                              group="data-parallel trajectory")


@pytest.mark.parity(recipes=["fp32"])  # the main job's smoke run; bf16 DDP is the one-step check above and nightly
def test_data_parallel_trajectory(parity):
    """Two ranks train the tiny Aurora as upstream trains (AdamW, clip 1.0, constant lr) on halves of the real
    CO2 batches, DDP all-reducing the gradients each step, against the single-process equivalent; judged by the
    loss and grad-norm curves (``runtime.distributed_trajectory``)."""
    _data_parallel_trajectory(parity, SMOKE_STEPS)


@pytest.mark.parity_nightly
def test_data_parallel_trajectory_long(parity):
    _data_parallel_trajectory(parity, NIGHTLY_STEPS)
