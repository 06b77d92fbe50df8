"""Training faults planted on the target of the Aurora trajectory check, as a port's runtime could change it.

Each fault is a context manager that changes what a ``runtime.trajectory.TrajectoryLoop`` run computes while
it is entered; :func:`faulty_target` wraps one in the NPU patch set, so that it stands in for a suite's
``parity_patches`` on the target side only. Used by ``tests/aurora/test_trajectory_faults.py`` (each fault
fails the check, naming the step) and ``benchmarks/calibrate_trajectory.py`` (the calibration table).

=====================  ==================================================================================
fault                  what the target does instead
=====================  ==================================================================================
``weight``             one decoder FFN weight × (1 + 1e-4) (``checks.TRAIN_STEP_FAULT``)
``eps``                AdamW's eps × 10 (a fused optimizer with another default)
``clip``               no gradient clipping
``dropout``            every dropout of probability 0.2 at 0.1 (another config)
``schedule``           the learning rate one step ahead (a scheduler stepped before the optimizer)
``fp16_unscale``       ``clip_grad_norm_`` on the scaled fp16 gradients (``unscale_`` only inside
                       ``scaler.step``): the AMP bug of a hand-written loop
``no_master_weights``  AdamW steps bf16 weights themselves, without DeepSpeed's float32 master weights
=====================  ==================================================================================
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, ContextManager, Iterator

import torch

from . import checks, patches

__all__ = ["FAULTS", "fault", "faulty_target"]


@contextlib.contextmanager
def _eps_times_10(model: torch.nn.Module) -> Iterator[None]:
    adamw = torch.optim.AdamW
    torch.optim.AdamW = lambda params, **kw: adamw(params, **dict(kw, eps=kw["eps"] * 10))
    try:
        yield
    finally:
        torch.optim.AdamW = adamw


@contextlib.contextmanager
def _no_clipping(model: torch.nn.Module) -> Iterator[None]:
    clip = torch.nn.utils.clip_grad_norm_
    torch.nn.utils.clip_grad_norm_ = lambda params, max_norm, **kw: clip(params, math.inf, **kw)
    try:
        yield
    finally:
        torch.nn.utils.clip_grad_norm_ = clip


@contextlib.contextmanager
def _lr_one_step_ahead(model: torch.nn.Module) -> Iterator[None]:
    from ..runtime.trajectory import TrajectoryLoop

    lr_at = TrajectoryLoop.lr_at
    TrajectoryLoop.lr_at = lambda self, step: lr_at(self, step + 1)
    try:
        yield
    finally:
        TrajectoryLoop.lr_at = lr_at


@contextlib.contextmanager
def _dropout_01(model: torch.nn.Module) -> Iterator[None]:
    changed = [m for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p == 0.2]
    if not changed:
        raise ValueError("the dropout fault needs a model with dropout 0.2 (the tiny Aurora has it)")
    for m in changed:
        m.p = 0.1
    try:
        yield
    finally:
        for m in changed:
            m.p = 0.2


@contextlib.contextmanager
def _weight(model: torch.nn.Module) -> Iterator[None]:
    with checks.scaled_parameter(model, checks.TRAIN_STEP_FAULT, 1 + 1e-4):
        yield


@contextlib.contextmanager
def _fp16_clip_before_unscale(model: torch.nn.Module) -> Iterator[None]:
    from ..runtime import recipes

    make = recipes.make_grad_scaler

    def buggy(device: Any) -> Any:
        scaler = make(device)
        unscale, step = scaler.unscale_, scaler.step
        scaler.unscale_ = lambda optimizer: None

        def late_step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            unscale(optimizer)
            return step(optimizer, *args, **kwargs)
        scaler.step = late_step
        return scaler
    recipes.make_grad_scaler = buggy
    try:
        yield
    finally:
        recipes.make_grad_scaler = make


@contextlib.contextmanager
def _no_master_weights(model: torch.nn.Module) -> Iterator[None]:
    from ..runtime import trajectory

    copies = trajectory._master_copies
    trajectory._master_copies = lambda params: {}
    try:
        yield
    finally:
        trajectory._master_copies = copies


#: fault name -> ``(model) -> context manager`` (module docstring).
FAULTS: dict[str, Callable[[torch.nn.Module], ContextManager[None]]] = {
    "weight": _weight, "eps": _eps_times_10, "clip": _no_clipping, "dropout": _dropout_01,
    "schedule": _lr_one_step_ahead, "fp16_unscale": _fp16_clip_before_unscale,
    "no_master_weights": _no_master_weights,
}


def fault(name: str, model: torch.nn.Module) -> ContextManager[None]:
    """The fault ``name`` of :data:`FAULTS` on ``model``, as a context manager.

    Raises:
        KeyError: an unknown fault (the message lists the known ones).
    """
    if name not in FAULTS:
        raise KeyError(f"unknown training fault {name!r}; known: {', '.join(FAULTS)}")
    return FAULTS[name](model)


def faulty_target(name: str, model: torch.nn.Module) -> Callable[[torch.device], ContextManager[Any]]:
    """``(device) -> context manager``: the NPU patch set with the fault ``name`` inside it, for
    ``ParityCase(..., patches=faulty_target(name, model))`` (the target side only)."""
    fault(name, model)  # an unknown name fails here, not inside the run

    @contextlib.contextmanager
    def apply(device: torch.device) -> Iterator[Any]:
        with patches.patched(device) as patch_set, fault(name, model):
            yield patch_set
    return apply
