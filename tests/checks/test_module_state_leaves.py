"""What a run writes into the module's own buffers (BatchNorm's running statistics in a training-mode
forward, a key/value cache kept as a buffer) is compared like an output: leaves ``inplace:buffer:<path>``
(``runtime.input_changes.state_leaves``); the module itself is left as it was."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from pytest_npu_parity.baselines import SuiteStores
from pytest_npu_parity.compare import ParityError
from pytest_npu_parity.runner import ParityCase, ParitySession
from pytest_npu_parity.runtime.input_changes import STATE_META_KEY
from switches import switched

CPU = torch.device("cpu")
TEST_ID = "parity_suites/demo/test_state.py::t"
BN_LEAVES = ["inplace:buffer:1.num_batches_tracked", "inplace:buffer:1.running_mean", "inplace:buffer:1.running_var"]


def bn_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 4)).train()


def bn_input() -> torch.Tensor:
    return torch.randn(32, 8, generator=torch.Generator().manual_seed(1)) * 3 + 1


_batch_norm = F.batch_norm


def _momentum_half(input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5):
    """A batch_norm kernel that updates the running statistics with momentum 0.5 (the output is the same)."""
    return _batch_norm(input, running_mean, running_var, weight, bias, training, 0.5, eps)


def _no_update(input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5):
    """A batch_norm kernel that normalizes by the batch but never updates the running statistics."""
    return _batch_norm(input, None, None, weight, bias, True, momentum, eps)


wrong_momentum = switched(F, "batch_norm", _momentum_half)
no_update = switched(F, "batch_norm", _no_update)


class CacheWriter(torch.nn.Module):
    """Projects keys and writes them into its own key cache buffer at ``pos``, as a decoder's static cache
    does; ``CacheWriter.offset`` (1 on the target: one slot too far) plants the fault."""

    offset = 0

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.k = torch.nn.Linear(8, 8)
        self.register_buffer("cache", torch.zeros(2, 16, 8))

    def forward(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        k = self.k(x)
        start = pos + CacheWriter.offset
        self.cache[:, start:start + k.shape[1]] = k
        return k


one_slot_off = switched(CacheWriter, "offset", 1)


def cache_input() -> torch.Tensor:
    return torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("recipe", ["fp32", "bf16"])
def test_running_statistics_are_compared_and_a_wrong_momentum_fails_on_them_alone(recipe):
    model = bn_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    record = ParityCase(ParitySession(CPU, reference="cpu"), TEST_ID, recipe).check("bn", model, bn_input())
    assert record.status == "pass"
    assert [leaf.path for leaf in record.result.leaves] == ["", *BN_LEAVES]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the module is as it was
    # the outputs agree; only the running statistics are wrong (they passed before)
    with pytest.raises(ParityError) as failed:
        ParityCase(ParitySession(CPU, reference="cpu"), TEST_ID, recipe, patches=wrong_momentum).check(
            "bn", bn_model(), bn_input())
    assert sorted(leaf.path for leaf in failed.value.result.failures) == BN_LEAVES[1:]


def test_a_target_that_does_not_update_the_running_statistics_fails():
    with pytest.raises(ParityError, match="missing in actual output") as failed:
        ParityCase(ParitySession(CPU, reference="cpu"), TEST_ID, "fp32", patches=no_update).check(
            "bn", bn_model(), bn_input())
    # the module still counts the batch (num_batches_tracked) before calling the kernel
    assert sorted(leaf.path for leaf in failed.value.result.failures) == BN_LEAVES[1:]


@pytest.mark.parametrize("recipe", ["fp32", "bf16"])
def test_a_cache_buffer_written_one_slot_too_far_fails(recipe):
    record = ParityCase(ParitySession(CPU, reference="cpu"), TEST_ID, recipe).check(
        "cache", CacheWriter().eval(), cache_input(), pos=3)
    assert record.status == "pass" and [leaf.path for leaf in record.result.leaves] == ["", "inplace:buffer:cache"]
    with pytest.raises(ParityError, match="inplace:buffer:cache") as failed:
        ParityCase(ParitySession(CPU, reference="cpu"), TEST_ID, recipe, patches=one_slot_off).check(
            "cache", CacheWriter().eval(), cache_input(), pos=3)
    assert [leaf.path for leaf in failed.value.result.failures] == ["inplace:buffer:cache"]


def test_the_written_buffers_are_recorded_with_their_golden_and_compared_against_the_baseline(tmp_path):
    store = SuiteStores(tmp_path)
    recording = ParityCase(ParitySession(CPU, update_baselines=True, store=store), TEST_ID, "bf16")
    recording.check("bn", bn_model(), bn_input())
    assert recording.finish() == "created"
    entry = store.load(TEST_ID).checks["bn"]
    assert entry.meta[STATE_META_KEY] is True
    assert "inplace:buffer:1.running_mean" in entry.tensors and "golden:inplace:buffer:1.running_mean" in entry.extras
    assert ParityCase(ParitySession(CPU, store=store), TEST_ID, "bf16").check(
        "bn", bn_model(), bn_input()).status == "pass"
    with pytest.raises(ParityError, match=r"inplace:buffer:1.running_mean"):
        ParityCase(ParitySession(CPU, store=store), TEST_ID, "bf16", patches=wrong_momentum).check(
            "bn", bn_model(), bn_input())
    with pytest.raises(ParityError, match="missing in actual output"):
        ParityCase(ParitySession(CPU, store=store), TEST_ID, "bf16", patches=no_update).check(
            "bn", bn_model(), bn_input())


def test_a_baseline_recorded_before_the_buffers_were_stored_says_they_are_not_compared(tmp_path):
    store = SuiteStores(tmp_path)
    recording = ParityCase(ParitySession(CPU, update_baselines=True, store=store), TEST_ID, "fp32")
    recording.check("cache", CacheWriter().eval(), cache_input(), pos=3)
    assert recording.finish() == "created"
    baseline = store.load(TEST_ID)
    entry = baseline.checks["cache"]
    older = dataclasses.replace(entry, tensors={k: v for k, v in entry.tensors.items() if not k.startswith("inplace:")},
                                meta={k: v for k, v in entry.meta.items() if k != STATE_META_KEY})
    store.write(TEST_ID, {"cache": older}, baseline.provenance)
    record = ParityCase(ParitySession(CPU, store=store), TEST_ID, "fp32").check(
        "cache", CacheWriter().eval(), cache_input(), pos=3)
    assert record.status == "pass" and [leaf.path for leaf in record.result.leaves] == [""]
    assert ("the values written in place into buffer:cache not compared: the baseline was recorded before they "
            "were stored (re-record with --update-baselines)") in record.extra["policy_note"]
