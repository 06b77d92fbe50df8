"""Every Aurora submodule and helper function, reference vs target, fp32 and bf16."""
import pytest

from pytest_npu_parity.aurora.checks import SUBMODULE_CHECKS


@pytest.mark.parametrize("check", SUBMODULE_CHECKS, ids=str)
def test_submodule(parity, aurora, check):
    fn, args, kwargs = check.build(aurora)
    parity.check(check.name, fn, *args, submodule=check.submodule or None, group=check.group,
                 fault_weight=check.fault_weight, sample_dim=check.sample_dim, **kwargs)
