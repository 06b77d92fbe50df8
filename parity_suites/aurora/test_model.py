"""The whole model: AuroraModel, AuroraForPrediction forward (eval and training loss) and generate()."""
import pytest

from pytest_npu_parity.aurora.checks import MODEL_CHECKS


@pytest.mark.parametrize("check", MODEL_CHECKS, ids=str)
def test_model(parity, aurora, check):
    fn, args, kwargs = check.build(aurora)
    parity.check(check.name, fn, *args, submodule=check.submodule or None, group=check.group,
                 fault_weight=check.fault_weight, sample_dim=check.sample_dim, **kwargs)
