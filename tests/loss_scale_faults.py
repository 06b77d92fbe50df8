"""Wrong loss scaling on the target side, for proving that fp16 training checks have teeth.

Each fault is a ``torch.amp.GradScaler`` subclass that the target run gets instead of the recipe's
scaler (``recipes.make_grad_scaler``, swapped by :func:`target_scaler` inside the target's patch set,
as a port's own code would swap it); the reference keeps the real one.

* :class:`StaleInverseScale` — ``unscale_`` divides by the scale the scaler *started* with, not the
  one the loss was multiplied by: a cached reciprocal not refreshed after a backoff (torch_npu's
  ``GradScaler.unscale_`` computes ``inv_scale`` from ``self._scale`` on every call precisely so that
  this cannot happen). After one overflow the gradients come out halved.
* :class:`MissedOverflow` — an overflowing fp16 backward is not detected: non-finite gradients
  saturate to ±65504 (fp16's largest value) before the overflow check, as on an NPU in saturation
  mode whose float-status check is missed (torch_npu: ``INF_NAN_MODE_ENABLE=0`` / Ascend 910A, where
  the scaler reads the overflow from the NPU's float-status register instead of the gradients,
  ``torch_npu/npu/amp/grad_scaler.py``, ``get_npu_overflow_flag``), so the step is taken with the
  saturated gradients instead of being skipped.
"""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Iterator

import torch

from pytest_npu_parity.runtime import recipes  # where the train step reads make_grad_scaler

FP16_MAX = float(torch.finfo(torch.float16).max)  # 65504


class StaleInverseScale(torch.amp.GradScaler):
    """Unscales with ``1 / init_scale`` whatever the scale is now."""

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        factor = self.get_scale() / self._init_scale  # 0.5 after one backoff: the grads end up halved
        if factor != 1.0:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is not None:
                        param.grad.mul_(factor)
        super().unscale_(optimizer)


class MissedOverflow(torch.amp.GradScaler):
    """Saturates non-finite gradients to ±65504 before the overflow check, which then finds none."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):  # torch.amp's private hook
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    torch.nan_to_num_(param.grad, nan=0.0, posinf=FP16_MAX, neginf=-FP16_MAX)
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)


FAULTS = {"stale_inverse_scale": StaleInverseScale, "missed_overflow": MissedOverflow}


def target_scaler(fault: type, patches: Callable[[torch.device], ContextManager] | None = None
                  ) -> Callable[[torch.device], ContextManager]:
    """A patch factory: ``patches(device)`` (if given) plus ``recipes.make_grad_scaler`` returning
    ``fault(device.type)`` inside the block (restored on exit)."""

    @contextlib.contextmanager
    def apply(device: torch.device) -> Iterator[None]:
        original = recipes.make_grad_scaler
        recipes.make_grad_scaler = lambda d: fault(torch.device(d).type)
        try:
            with patches(device) if patches is not None else contextlib.nullcontext():
                yield
        finally:
            recipes.make_grad_scaler = original

    return apply
