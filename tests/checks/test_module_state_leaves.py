"""What a run writes into the module's own buffers (BatchNorm's running statistics in a training-mode
forward, a key/value cache kept as a buffer) is compared like an output: leaves ``inplace:buffer:<path>``
(``runtime.input_changes.state_leaves``); the module itself is left as it was."""
from __future__ import annotations

import contextlib
import copy
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


def test_buffers_written_by_one_side_only_are_named_in_a_note_not_failed():
    """A target kernel that leaves the running statistics alone: the reference's written buffers are named,
    not judged (one code path may keep a memo the other does not: ``test_a_memo_kept_by_the_reference_only``)."""
    record = ParityCase(ParitySession(CPU, reference="cpu"), TEST_ID, "fp32", patches=no_update).check(
        "bn", bn_model(), bn_input())
    # the module still counts the batch (num_batches_tracked) before calling the kernel: compared
    assert record.status == "pass" and [leaf.path for leaf in record.result.leaves] == ["", BN_LEAVES[0]]
    assert ("the values written in place into buffer:1.running_mean, buffer:1.running_var not compared: written "
            "by the reference run only") in record.extra["policy_note"]


class Rope(torch.nn.Module):
    """Rotary embedding whose reference path memoizes cos/sin in buffers; ``Rope.fused`` (the target's kernel)
    computes them on the fly: the same output, no buffer written."""

    fused = False

    def __init__(self, d: int = 16, max_pos: int = 64) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), persistent=False)
        self.register_buffer("cos_cached", torch.zeros(max_pos, d), persistent=False)
        self.register_buffer("cached_len", torch.zeros((), dtype=torch.long), persistent=False)

    def _cos(self, n: int) -> torch.Tensor:
        f = torch.outer(torch.arange(n, dtype=self.inv_freq.dtype), self.inv_freq)
        return torch.cat([f, f], -1).cos()

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        n = q.shape[-2]
        if Rope.fused:
            return q * self._cos(n)
        if int(self.cached_len) < n:
            self.cos_cached[:n] = self._cos(n)
            self.cached_len.fill_(n)
        return q * self.cos_cached[:n]


@pytest.mark.parametrize("recipe", ["fp32", "bf16"])
def test_a_memo_kept_by_the_reference_only_passes_with_a_note(recipe):
    record = ParityCase(ParitySession(CPU, reference="cpu"), TEST_ID, recipe, patches=switched(Rope, "fused", True)).check(
        "rope", Rope().eval(), torch.randn(2, 32, 16, generator=torch.Generator().manual_seed(1)))
    assert record.status == "pass"
    assert ("buffer:cached_len, buffer:cos_cached not compared: written by the reference run only"
            in record.extra["policy_note"])


class SharedCache(torch.nn.Module):
    """Two submodules hold one cache tensor; the second writes it (``SharedCache.scale`` 3 on the target)."""

    scale = 1.0

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        shared = torch.zeros(4, 8)
        self.lin = torch.nn.Linear(8, 8)
        self.a, self.b = torch.nn.Module(), torch.nn.Module()
        self.a.register_buffer("cache", shared)
        self.b.register_buffer("cache", shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        self.b.cache.copy_(y * SharedCache.scale)
        return y * 2


@pytest.mark.parametrize("recipe", ["fp32", "bf16"])
def test_a_shared_buffer_is_compared_under_the_name_of_the_slot_written(recipe):
    """The golden run's float64 copy unties the two slots, as a device placement would: the written slot
    (b.cache) is compared on every side; a.cache, untied there, is left out with a note."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    record = ParityCase(ParitySession(CPU, reference="cpu"), TEST_ID, recipe).check("m", SharedCache().eval(), x)
    assert record.status == "pass" and "inplace:buffer:b.cache" in [leaf.path for leaf in record.result.leaves]
    with pytest.raises(ParityError, match=r"inplace:buffer:b.cache"):
        ParityCase(ParitySession(CPU, reference="cpu"), TEST_ID, recipe, patches=switched(SharedCache, "scale", 3.0)
                   ).check("m", SharedCache().eval(), x)


class Untied(ParitySession):
    """The target's placement as ``.to(device)`` builds it on a device: every buffer slot its own tensor."""

    def place(self, module, device, dtype=None):
        if getattr(self, "on_target", False):
            return copy.deepcopy(module)._apply(lambda t: t.clone())
        return super().place(module, device, dtype)


def test_a_shared_buffer_untied_by_the_targets_placement_passes():
    @contextlib.contextmanager
    def on_target(device):
        session.on_target = True
        try:
            yield
        finally:
            session.on_target = False
    session = Untied(CPU, reference="cpu")
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    record = ParityCase(session, TEST_ID, "fp32", patches=on_target).check("m", SharedCache().eval(), x)
    assert record.status == "pass" and "inplace:buffer:b.cache" in [leaf.path for leaf in record.result.leaves]
    assert "buffer:a.cache not compared: written by the reference run only" in record.extra["policy_note"]


class Rebinding(torch.nn.Module):
    """Grows a key cache by rebinding its buffer (``torch.cat``), and fills a ``None`` buffer on first use;
    ``Rebinding.scale`` (3 on the target) plants the fault in both."""

    scale = 1.0

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.k = torch.nn.Linear(8, 8)
        self.register_buffer("cache", torch.zeros(2, 0, 8))
        self.register_buffer("lazy", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.k(x)
        self.cache = torch.cat([self.cache, k * Rebinding.scale], 1)
        if self.lazy is None:
            self.lazy = torch.zeros(2, 16, 8)
        self.lazy[:, :k.shape[1]] = k * Rebinding.scale
        return k


@pytest.mark.parametrize("recipe", ["fp32", "bf16"])
def test_a_buffer_rebound_or_filled_on_first_use_is_compared(recipe):
    x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(2))
    model = Rebinding().eval()
    record = ParityCase(ParitySession(CPU, reference="cpu"), TEST_ID, recipe).check("m", model, x)
    assert record.status == "pass"
    assert [leaf.path for leaf in record.result.leaves] == ["", "inplace:buffer:cache", "inplace:buffer:lazy"]
    assert model.lazy is None and model.cache.shape == (2, 0, 8)  # put back
    with pytest.raises(ParityError) as failed:
        ParityCase(ParitySession(CPU, reference="cpu"), TEST_ID, recipe, patches=switched(Rebinding, "scale", 3.0)
                   ).check("m", Rebinding().eval(), x)
    assert [leaf.path for leaf in failed.value.result.failures] == ["inplace:buffer:cache", "inplace:buffer:lazy"]


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
    record = ParityCase(ParitySession(CPU, store=store), TEST_ID, "bf16", patches=no_update).check(
        "bn", bn_model(), bn_input())
    assert "not compared: written by the reference run only" in record.extra["policy_note"]


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
