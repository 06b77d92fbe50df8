"""Training faults a port's runtime can plant in a training loop, as context managers, for showing that a
trajectory check fails on them (``ParityCase.trajectory`` with the fault inside the target's patches).

Each changes what a ``runtime.trajectory.TrajectoryLoop`` run computes while it is entered and restores
everything on exit:

===========================  ============================================================================
fault                        what the loop does instead
===========================  ============================================================================
:func:`adamw_eps_times`      AdamW's eps times a factor (a fused optimizer with another default)
:func:`no_clipping`          no gradient clipping (``clip_grad_norm_`` with an infinite max norm)
:func:`lr_one_step_ahead`    the learning rate of the next step (a scheduler stepped before the optimizer)
:func:`dropout_at`           every dropout of one probability at another (another config)
:func:`clip_before_unscale`  ``clip_grad_norm_`` on the scaled fp16 gradients (``unscale_`` only inside
                             ``scaler.step``): the AMP bug of a hand-written loop
:func:`no_master_weights`    AdamW steps bf16/fp16 weights themselves, without float32 master weights
===========================  ============================================================================

A weight fault is ``diagnose.selfcheck.scaled_parameter``.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import torch

__all__ = ["adamw_eps_times", "no_clipping", "lr_one_step_ahead", "dropout_at", "clip_before_unscale",
           "no_master_weights"]


@contextlib.contextmanager
def _replaced(owner: Any, attr: str, replacement: Any) -> Iterator[None]:
    original = getattr(owner, attr)
    setattr(owner, attr, replacement(original))
    try:
        yield
    finally:
        setattr(owner, attr, original)


def adamw_eps_times(factor: float) -> contextlib.AbstractContextManager:
    """``torch.optim.AdamW`` built with ``eps`` × ``factor``."""
    return _replaced(torch.optim, "AdamW",
                     lambda adamw: lambda params, **kw: adamw(params, **dict(kw, eps=kw["eps"] * factor)))


def no_clipping() -> contextlib.AbstractContextManager:
    """``torch.nn.utils.clip_grad_norm_`` with an infinite max norm (it still returns the norm)."""
    return _replaced(torch.nn.utils, "clip_grad_norm_",
                     lambda clip: lambda params, max_norm, **kw: clip(params, math.inf, **kw))


def lr_one_step_ahead() -> contextlib.AbstractContextManager:
    """``TrajectoryLoop.lr_at(step)`` gives step + 1's learning rate (changes only a scheduled lr)."""
    from .trajectory import TrajectoryLoop

    return _replaced(TrajectoryLoop, "lr_at", lambda lr_at: lambda self, step: lr_at(self, step + 1))


@contextlib.contextmanager
def dropout_at(model: torch.nn.Module, old: float, new: float) -> Iterator[None]:
    """Every ``nn.Dropout`` of ``model`` with ``p == old`` at ``p = new``.

    Raises:
        ValueError: ``model`` has no dropout of probability ``old``.
    """
    changed = [m for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p == old]
    if not changed:
        raise ValueError(f"dropout_at: the model has no nn.Dropout of p={old}")
    for m in changed:
        m.p = new
    try:
        yield
    finally:
        for m in changed:
            m.p = old


def clip_before_unscale() -> contextlib.AbstractContextManager:
    """``recipes.make_grad_scaler`` returns a scaler whose ``unscale_`` does nothing and whose ``step``
    unscales first: the loop clips (and measures) the scaled gradients."""
    from . import recipes

    def buggy(make: Any) -> Any:
        def scaler_for(device: Any) -> Any:
            scaler = make(device)
            unscale, step = scaler.unscale_, scaler.step
            scaler.unscale_ = lambda optimizer: None

            def late_step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
                unscale(optimizer)
                return step(optimizer, *args, **kwargs)
            scaler.step = late_step
            return scaler
        return scaler_for
    return _replaced(recipes, "make_grad_scaler", buggy)


def no_master_weights() -> contextlib.AbstractContextManager:
    """``TrajectoryLoop`` keeps no float32 master weights: AdamW steps the bf16/fp16 weights themselves."""
    from . import trajectory

    return _replaced(trajectory, "_master_copies", lambda copies: lambda params: {})
