"""A 1e-4-inaccurate op in one fallback of the NPU patch set, on the seeded Aurora: named by op and by patch.

The patch set's ``resample`` (patch ``resample``: the kernel resampling of the patch embedding, whose
``pinv`` runs on the CPU where the device lacks it) computes the resampled kernel with a matmul. The
planted fault: inside that fallback the matmul kernel is 1e-4 inaccurate (``aten.mm``'s output
× (1 + 1e-4), as a device kernel or a host fallback of lower accuracy would be); the same op called
outside the fallback is exact, so upstream's own ``resample`` (the patch turned off) computes the
reference's values. The fault is on the target side only (inside its patch factory); the reference is a
live CPU run of unpatched upstream.

The failing check of the patch embedding at patch length 96 (``patch_embedding_eval_96``, which
resamples the 48-long kernel) must name:
* the op: ``aten.mm``, local error 1e-4 (beyond the float32 budget), in the patch embedding's own code,
  at the model's line that calls ``resample``;
* the patch: turning ``resample`` off alone, the rest of the set in force, makes the check pass (root
  cause); the bisection clears the other patches.
"""
from __future__ import annotations

import contextlib
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from pytest_npu_parity.aurora import checks, patches
from pytest_npu_parity.compare import ParityError
from pytest_npu_parity.localize import Localizer
from pytest_npu_parity.runner import ParityCase, ParitySession

aten = torch.ops.aten


class _InaccurateFallbackKernel(TorchDispatchMode):
    """``aten.mm`` 1e-4 off while the patch set's ``resample`` fallback runs (a frame of it is on the
    stack: no wrapper frame is added, so the op's source line is what the trace finds in the model);
    exact elsewhere."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is aten.mm.default and _in_fallback():
            with _disable_current_modes():
                return out * (1 + 1e-4)
        return out


def _in_fallback() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is patches.resample.__code__:
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def _inaccurate_fallback(device):
    with patches.patched(device) as patch_set, _InaccurateFallbackKernel():
        yield patch_set


def test_an_inaccurate_resample_fallback_is_named_by_op_and_by_patch(aurora_ctx):
    session = ParitySession(torch.device("cpu"), reference="cpu", failure_hooks=[Localizer(budget_s=None)])
    check = checks.BY_NAME["patch_embedding_eval_96"]
    fn, args, kwargs = check.build(aurora_ctx)
    case = ParityCase(session, "tests/aurora/test_patch_fallback_fault.py::resample", "fp32", patches=_inaccurate_fallback)
    with pytest.raises(ParityError) as info:
        case.check(check.name, fn, *args, submodule=check.submodule or None, **kwargs)
    message = str(info.value)
    record = case.records[-1]
    print(message)
    ops = record.localized.localization_ops
    first = next(row for row in ops if row["first_op"])
    assert first["op"] == "aten.mm" and first["verdict"] == "local", message
    assert first["local"] == pytest.approx(1e-4, rel=0.05), message
    counterfactual = [row for row in record.whatfix.counterfactual if row["kind"] == "counterfactual"]
    single = {row["patches"][0]: row for row in counterfactual if row["patches"] and len(row["patches"]) == 1}
    assert single["resample"]["verdict"] == "root cause" and single["resample"]["passed"], message
    assert all(row["verdict"] == "no effect" for name, row in single.items() if name != "resample"), message
    assert "patch resample turned off, the rest of the patch set in force" in message
