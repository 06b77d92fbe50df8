"""Training faults planted on the target of the Aurora trajectory check, as a port's runtime could change it.

The faults are ``runtime.training_faults``' (and ``diagnose.selfcheck.scaled_parameter``) with the tiny Aurora's
specifics; :func:`faulty_target` wraps one in the NPU patch set, so that it stands in for a suite's
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
from typing import Any, Callable, ContextManager, Iterator

import torch

from ..diagnose.selfcheck import scaled_parameter
from ..runtime import training_faults as faults
from . import checks, patches

__all__ = ["FAULTS", "fault", "faulty_target"]

#: fault name -> ``(model) -> context manager`` (module docstring).
FAULTS: dict[str, Callable[[torch.nn.Module], ContextManager[Any]]] = {
    "weight": lambda model: scaled_parameter(model, checks.TRAIN_STEP_FAULT, 1 + 1e-4),
    "eps": lambda model: faults.adamw_eps_times(10),
    "clip": lambda model: faults.no_clipping(),
    "dropout": lambda model: faults.dropout_at(model, 0.2, 0.1),
    "schedule": lambda model: faults.lr_one_step_ahead(),
    "fp16_unscale": lambda model: faults.clip_before_unscale(),
    "no_master_weights": lambda model: faults.no_master_weights(),
}


def fault(name: str, model: torch.nn.Module) -> ContextManager[Any]:
    """The fault ``name`` of :data:`FAULTS` on ``model``, as a context manager.

    Raises:
        KeyError: an unknown fault (the message lists the known ones).
    """
    if name not in FAULTS:
        raise KeyError(f"unknown training fault {name!r}; known: {', '.join(FAULTS)}")
    return FAULTS[name](model)


def faulty_target(name: str, model: torch.nn.Module) -> Callable[[torch.device], ContextManager[Any]]:
    """``(device) -> context manager``: the NPU patch set with the fault ``name`` inside it, for
    ``ParityCase(..., patches=faulty_target(name, model))`` (the target side only).

    Raises:
        KeyError: an unknown fault.
    """
    if name not in FAULTS:
        fault(name, model)  # raises, naming the known faults

    @contextlib.contextmanager
    def apply(device: torch.device) -> Iterator[Any]:
        with patches.patched(device) as patch_set, fault(name, model):
            yield patch_set
    return apply
