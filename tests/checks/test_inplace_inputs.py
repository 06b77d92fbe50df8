"""A computation that changes its input in place: every side runs on its own copy of the caller's
inputs, the caller's tensors are never changed, and a side that changes them differently fails."""
from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from pytest_npu_parity.baselines import SuiteStores
from pytest_npu_parity.compare import ParityError
from pytest_npu_parity.runner import ParityCase, ParitySession
from switches import switched

CPU = torch.device("cpu")
TEST_ID = "parity_suites/demo/test_m.py::t"


class Standardize(torch.nn.Module):
    """Normalizes its argument in place with fixed statistics (not idempotent), then projects it;
    ``Standardize.fault`` scales the std on the side that runs under the patch set."""

    std_scale = 1.0
    in_place = True

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.lin = torch.nn.Linear(8, 4)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(4, 8, generator=g))
            self.lin.bias.zero_()
        self.register_buffer("mean", torch.full((8,), 0.5))
        self.register_buffer("std", torch.full((8,), 2.0))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        std = self.std * Standardize.std_scale
        if Standardize.in_place:
            x.sub_(self.mean).div_(std)
            mask.logical_not_()
        else:
            x, mask = (x - self.mean) / std, ~mask
        return self.lin(x.masked_fill(mask, 0.0))


def target(std_scale: float = 1.0, in_place: bool = True):
    @contextlib.contextmanager
    def patches(device: torch.device):
        Standardize.std_scale, Standardize.in_place = std_scale, in_place
        try:
            yield
        finally:
            Standardize.std_scale, Standardize.in_place = 1.0, True
    return patches


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 8, generator=g), torch.rand(4, 8, generator=g) > 0.8


@pytest.mark.parametrize("recipe", ["fp32", "bf16"])
def test_a_clean_in_place_model_passes_and_the_callers_inputs_are_untouched(recipe):
    x, mask = inputs()
    x0, mask0 = x.clone(), mask.clone()
    record = ParityCase(ParitySession(CPU, reference="cpu"), TEST_ID, recipe).check("std", Standardize(), x, mask)
    assert record.status == "pass"
    assert torch.equal(x, x0) and torch.equal(mask, mask0)
    assert "changes its input(s) args[0], args[1] in place" in record.extra["policy_note"]
    if recipe == "fp32":  # both sides ran on the caller's values: the same computation, bitwise
        assert record.result.leaves[0].max_abs == 0.0


@pytest.mark.parametrize("recipe", ["fp32", "bf16"])
def test_a_planted_fault_in_the_in_place_normalization_fails(recipe):
    x, mask = inputs()
    case = ParityCase(ParitySession(CPU, reference="cpu"), TEST_ID, recipe, patches=target(std_scale=1.01))
    with pytest.raises(ParityError):
        case.check("std", Standardize(), x, mask)


def test_a_target_that_no_longer_changes_its_input_fails_naming_the_input():
    x, mask = inputs()
    case = ParityCase(ParitySession(CPU, reference="cpu"), TEST_ID, "fp32", patches=target(in_place=False))
    with pytest.raises(ParityError, match=r"args\[0\], args\[1\] on the reference only"):
        case.check("std", Standardize(), x, mask)


def test_a_model_that_changes_no_input_gets_no_note():
    x, mask = inputs()
    Standardize.in_place = False
    try:
        record = ParityCase(ParitySession(CPU, reference="cpu"), TEST_ID, "fp32").check("std", Standardize(), x, mask)
    finally:
        Standardize.in_place = True
    assert not (record.extra.get("policy_note") or "").count("in place")


@pytest.mark.parametrize("recipe", ["fp32", "bf16"])
def test_recorded_on_the_callers_input_and_compared_clean_against_the_baseline(tmp_path, recipe):
    store = SuiteStores(tmp_path)
    x, mask = inputs()
    recording = ParityCase(ParitySession(CPU, update_baselines=True, store=store), TEST_ID, recipe)
    recording.check("std", Standardize(), x, mask)
    assert recording.finish() == "created"
    # the fingerprint and summary are of the caller's (unchanged) input: a fresh copy compares fresh
    x, mask = inputs()
    record = ParityCase(ParitySession(CPU, store=store), TEST_ID, recipe).check("std", Standardize(), x, mask)
    assert record.status == "pass" and record.reference == "baseline"
    with pytest.raises(ParityError):
        ParityCase(ParitySession(CPU, store=store), TEST_ID, recipe, patches=target(std_scale=1.01)).check(
            "std", Standardize(), *inputs())


def test_a_train_step_on_an_in_place_model_passes_and_fails_a_fault():
    x, mask = inputs()
    x0 = x.clone()
    record = ParityCase(ParitySession(CPU, reference="cpu"), TEST_ID, "fp32").train_step(
        "step", Standardize(), (x, mask), loss_fn=lambda out: out.square().mean())
    assert record.status == "pass" and torch.equal(x, x0)
    with pytest.raises(ParityError):
        ParityCase(ParitySession(CPU, reference="cpu"), TEST_ID, "fp32", patches=target(std_scale=1.01)).train_step(
            "step", Standardize(), inputs(), loss_fn=lambda out: out.square().mean())


class Project(torch.nn.Module):
    """``x @ w``; with ``Project.clobber`` set (the target's patch set) the kernel also zeroes its input, as a
    device kernel that reuses the caller's buffer as workspace would."""

    clobber = False

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 4, generator=torch.Generator().manual_seed(0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.w
        if Project.clobber:
            x.mul_(0.0)
        return y


_clobbers = switched(Project, "clobber", True)


def test_a_target_that_changes_its_input_fails_against_a_baseline_that_recorded_none(tmp_path):
    store = SuiteStores(tmp_path)
    recording = ParityCase(ParitySession(CPU, update_baselines=True, store=store), TEST_ID, "fp32")
    recording.check("project", Project(), inputs()[0])
    assert recording.finish() == "created"
    assert store.load(TEST_ID).checks["project"].meta["input_changes"] == []
    assert ParityCase(ParitySession(CPU, store=store), TEST_ID, "fp32").check(
        "project", Project(), inputs()[0]).status == "pass"
    # the outputs agree; the target alone clobbers its argument (it passed before: the baseline did not say)
    with pytest.raises(ParityError, match=r"args\[0\] on the target only"):
        ParityCase(ParitySession(CPU, store=store), TEST_ID, "fp32", patches=_clobbers).check(
            "project", Project(), inputs()[0])


def test_an_in_place_model_recorded_with_its_changes_compares_clean_and_fails_a_target_that_drops_them(tmp_path):
    store = SuiteStores(tmp_path)
    x, mask = inputs()
    recording = ParityCase(ParitySession(CPU, update_baselines=True, store=store), TEST_ID, "fp32")
    recording.check("std", Standardize(), x, mask)
    assert recording.finish() == "created"
    assert store.load(TEST_ID).checks["std"].meta["input_changes"] == ["args[0]", "args[1]"]
    record = ParityCase(ParitySession(CPU, store=store), TEST_ID, "fp32").check("std", Standardize(), *inputs())
    assert record.status == "pass" and "changes its input(s) args[0], args[1] in place" in record.extra["policy_note"]
    with pytest.raises(ParityError, match=r"args\[0\], args\[1\] on the reference only"):
        ParityCase(ParitySession(CPU, store=store), TEST_ID, "fp32", patches=target(in_place=False)).check(
            "std", Standardize(), *inputs())


class Clamp6(torch.nn.Module):
    """An in-place clamp of its input at [0, 6] (``hardtanh(inplace=True)``, ReLU6's pattern), then a linear: whether
    it changes the input depends on the values."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.nn.functional.hardtanh(x, 0.0, 6.0, inplace=True))


def test_recorded_input_changes_apply_only_to_the_recorded_input_bitwise(tmp_path):
    # recorded from an input 1 ulp under the clamp (nothing changed); compared on one 1 ulp over it, which the summary
    # rule accepts as the same input (another machine's last bits), too large to be recorded for replay: the clamp
    # changes it on this side only, and that is no fault of the target's
    x = torch.rand(16, 64, generator=torch.Generator().manual_seed(1)) * 5
    x[3, 7] = torch.nextafter(torch.tensor(6.0), torch.tensor(0.0))
    store = SuiteStores(tmp_path)
    session = ParitySession(CPU, update_baselines=True, store=store)
    session.replay_limit = 0
    recording = ParityCase(session, TEST_ID, "fp32")
    recording.check("clamp", Clamp6(), x.clone())
    assert recording.finish() == "created"
    assert store.load(TEST_ID).checks["clamp"].meta["input_changes"] == []
    y = x.clone()
    y[3, 7] = torch.nextafter(torch.tensor(6.0), torch.tensor(7.0))
    record = ParityCase(ParitySession(CPU, store=store), TEST_ID, "fp32").check("clamp", Clamp6(), y)
    assert record.status == "pass" and "changes its input(s) args[0] in place" in record.extra["policy_note"]
    # the note says what was not judged, and why
    assert ("the baseline's reference changed no input in place, the target args[0]: not judged, since this "
            "input differs from the recorded one in its last bits") in record.extra["policy_note"]


class FillCache(torch.nn.Module):
    """Writes ``tanh(x)`` into the cache it is given (a key/value cache's pattern) and returns a projection of
    ``x``; ``FillCache.scale`` scales what the side under the patch set writes."""

    scale = 1.0

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.o = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        cache.copy_(torch.tanh(x) * FillCache.scale)
        return self.o(x)


_writes_wrong = switched(FillCache, "scale", 1.01)


def cache_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(2)), torch.zeros(4, 8)


@pytest.mark.parametrize("recipe", ["fp32", "bf16"])
def test_what_the_computation_writes_into_its_input_is_compared_like_an_output(recipe):
    record = ParityCase(ParitySession(CPU, reference="cpu"), TEST_ID, recipe).check("fill", FillCache(), *cache_inputs())
    assert record.status == "pass"
    assert [leaf.path for leaf in record.result.leaves] == ["", "inplace:args[1]"]
    # the outputs agree; only the values written into the cache are wrong (they passed before)
    with pytest.raises(ParityError, match=r"inplace:args\[1\]") as failed:
        ParityCase(ParitySession(CPU, reference="cpu"), TEST_ID, recipe, patches=_writes_wrong).check(
            "fill", FillCache(), *cache_inputs())
    assert [leaf.path for leaf in failed.value.result.failures] == ["inplace:args[1]"]


def test_the_written_values_are_recorded_and_compared_against_the_baseline(tmp_path):
    store = SuiteStores(tmp_path)
    recording = ParityCase(ParitySession(CPU, update_baselines=True, store=store), TEST_ID, "bf16")
    recording.check("fill", FillCache(), *cache_inputs())
    assert recording.finish() == "created"
    entry = store.load(TEST_ID).checks["fill"]
    assert "inplace:args[1]" in entry.tensors and "golden:inplace:args[1]" in entry.extras
    assert ParityCase(ParitySession(CPU, store=store), TEST_ID, "bf16").check(
        "fill", FillCache(), *cache_inputs()).status == "pass"
    with pytest.raises(ParityError, match=r"inplace:args\[1\]"):
        ParityCase(ParitySession(CPU, store=store), TEST_ID, "bf16", patches=_writes_wrong).check(
            "fill", FillCache(), *cache_inputs())


def test_a_baseline_recorded_before_the_written_values_were_stored_says_they_are_not_compared(tmp_path):
    store = SuiteStores(tmp_path)
    recording = ParityCase(ParitySession(CPU, update_baselines=True, store=store), TEST_ID, "fp32")
    recording.check("fill", FillCache(), *cache_inputs())
    assert recording.finish() == "created"
    baseline = store.load(TEST_ID)
    entry = baseline.checks["fill"]
    older = dataclasses.replace(entry, tensors={k: v for k, v in entry.tensors.items() if not k.startswith("inplace:")})
    store.write(TEST_ID, {"fill": older}, baseline.provenance)
    record = ParityCase(ParitySession(CPU, store=store), TEST_ID, "fp32").check("fill", FillCache(), *cache_inputs())
    assert record.status == "pass" and [leaf.path for leaf in record.result.leaves] == [""]
    assert ("the values written in place into args[1] not compared: the baseline was recorded before they were "
            "stored (re-record with --update-baselines)") in record.extra["policy_note"]


def test_an_input_changed_on_one_side_only_is_judged_as_such_not_as_a_missing_leaf():
    x, mask = inputs()
    case = ParityCase(ParitySession(CPU, reference="cpu"), TEST_ID, "fp32", patches=target(in_place=False))
    with pytest.raises(ParityError) as failed:
        case.check("std", Standardize(), x, mask)
    assert "on the reference only" in str(failed.value) and "missing" not in str(failed.value)


def test_an_output_leaf_named_like_a_written_input_is_a_clear_error():
    from pytest_npu_parity.runtime.input_changes import inplace_leaves

    with pytest.raises(ValueError, match=r"output leaf named 'inplace:args\[1\]'.*rename that output key"):
        inplace_leaves([("args[1]", torch.zeros(2))], {"inplace:args[1]": torch.ones(2)})


class FillCacheUnused(FillCache):
    """``FillCache`` with a parameter that affects nothing (a self-check fault weight without teeth)."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = torch.nn.Parameter(torch.ones(4, 4))


def _older(store: SuiteStores, *, goldens: bool = True) -> None:
    """The file as recorded before the written values were stored (and, ``goldens=False``, before goldens)."""
    baseline = store.load(TEST_ID)
    entry = baseline.checks["fill"]
    older = dataclasses.replace(entry, tensors={k: v for k, v in entry.tensors.items() if not k.startswith("inplace:")})
    if not goldens:
        older = dataclasses.replace(older, extras={k: v for k, v in older.extras.items() if not k.startswith("golden:")},
                                    meta={k: v for k, v in older.meta.items() if k != "golden"})
    store.write(TEST_ID, {"fill": older}, baseline.provenance)


def test_a_self_check_against_an_older_baseline_still_finds_a_weight_without_teeth(tmp_path):
    from pytest_npu_parity.diagnose.selfcheck import SelfCheck

    store = SuiteStores(tmp_path)
    recording = ParityCase(ParitySession(CPU, update_baselines=True, store=store), TEST_ID, "fp32")
    recording.check("fill", FillCacheUnused(), *cache_inputs())
    recording.finish()
    _older(store)
    # the re-run's inplace: leaf, absent from the older baseline, was counted as the fault being caught
    case = ParityCase(ParitySession(CPU, store=store, check_hooks=[SelfCheck()]), TEST_ID, "fp32")
    with pytest.raises(ParityError, match="has no teeth"):
        case.check("fill", FillCacheUnused(), *cache_inputs(), fault_weight="unused")


@pytest.mark.parametrize("recipe", ["fp32", "bf16"])
def test_store_goldens_adds_the_golden_of_an_older_baseline_of_an_in_place_model(tmp_path, recipe):
    store = SuiteStores(tmp_path)
    recording = ParityCase(ParitySession(CPU, update_baselines=True, store=store), TEST_ID, recipe)
    recording.check("fill", FillCache(), *cache_inputs(), policy="golden")
    recording.finish()
    _older(store, goldens=False)
    session = ParitySession(CPU, store=store)
    session.store_goldens = True
    case = ParityCase(session, TEST_ID, recipe)
    record = case.check("fill", FillCache(), *cache_inputs(), policy="golden")
    assert record.status == "pass" and "golden not added" not in record.extra["policy_note"]
    assert list(case._golden_additions) == ["fill"]


def test_a_sampling_check_judged_as_distributions_leaves_the_written_values_out_and_says_so():
    class Sampler(FillCache):
        def forward(self, x, cache):
            h = torch.tanh(self.o(x))
            cache[:, :4].copy_(h)
            return h.mean(0) + torch.randn(256, 4)  # 256 samples along dim 0

    record = ParityCase(ParitySession(CPU, reference="cpu", rng="device"), TEST_ID, "fp32").check(
        "sample", Sampler(), *cache_inputs(), sample_dim=0)
    assert record.status == "pass"
    assert ("the values written in place into args[1] not compared: the check is judged as distributions"
            in record.extra["policy_note"])


class Threshold(torch.nn.Module):
    """Zeroes its input where it is >= 6 in place (value-dependent), then projects it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.masked_fill_(x >= 6, 0.0)
        return self.lin(x)


def test_a_value_the_golden_run_did_not_write_is_left_out_not_failed():
    # bf16-weights rounds 5.99 to 6.0: both sides zero it, the float64 golden run leaves 5.99 alone
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    x[0, 0] = 5.99
    record = ParityCase(ParitySession(CPU, reference="cpu"), TEST_ID, "bf16-weights").check(
        "threshold", Threshold(), x, policy="golden")
    assert record.status == "pass" and [leaf.path for leaf in record.result.leaves] == [""]
    assert "the values written in place into args[0] not compared: the golden run did not change that input" in \
        record.extra["policy_note"]
