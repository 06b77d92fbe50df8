"""Compact training-step baselines: deterministic samples and summaries of large leaves, recorded
and compared through the runner, still failing on a 1e-4 weight fault."""
from __future__ import annotations

import contextlib
from typing import Iterator

import pytest
import torch

from pytest_npu_parity.baselines import BaselineStore
from pytest_npu_parity.compact import (DEFAULT_MIN_NUMEL, DEFAULT_SAMPLES, TrainStore, apply_recorded, base_leaf,
                                       compact_leaves, leaf_stats, parse_train_store, sample_indices)
from pytest_npu_parity.compare import ParityError
from pytest_npu_parity.runner import ParityCase, ParitySession, rounding_level_params


def test_sample_indices_are_deterministic_distinct_sorted_and_pinned():
    index = sample_indices("grad.layer1.0.conv1.weight", 36864, 4096)
    assert index.dtype == torch.int64 and index.shape == (4096,)
    assert torch.equal(index, sample_indices("grad.layer1.0.conv1.weight", 36864, 4096))
    assert torch.equal(index, index.unique(sorted=True)) and 0 <= int(index.min()) and int(index.max()) < 36864
    # another leaf, or the same name with another size, samples other positions
    assert not torch.equal(index, sample_indices("param.layer1.0.conv1.weight", 36864, 4096))
    assert not torch.equal(index[:100], sample_indices("grad.layer1.0.conv1.weight", 36865, 4096)[:100])
    # Pinned: recorded baselines depend on these positions (integer arithmetic only, PCG64 raw bits).
    assert sample_indices("grad.w", 100000, 8).tolist() == PINNED
    with pytest.raises(ValueError, match="cannot sample 10 of 10 elements"):
        sample_indices("grad.w", 10, 10)


PINNED = [10942, 15411, 29289, 47993, 49385, 53359, 77759, 99647]


def _first_distinct(path: str, numel: int, samples: int) -> list[int]:
    """The sampling rule of the module docstring, element by element: the first ``samples`` distinct
    values of the PCG64 raw outputs mod ``numel``, drawn ``2 * samples`` at a time, sorted."""
    import hashlib

    import numpy as np

    bits = np.random.PCG64(int.from_bytes(hashlib.sha256(f"{path}|{numel}".encode()).digest()[:8], "little"))
    chosen: dict[int, None] = {}
    while len(chosen) < samples:
        for value in (bits.random_raw(2 * samples) % np.uint64(numel)).tolist():
            chosen.setdefault(int(value))
            if len(chosen) == samples:
                break
    return sorted(chosen)


@pytest.mark.parametrize("numel,samples", [(100000, 8), (393216, 64), (36864, 4096), (65, 64), (70, 64),
                                           (130, 64), (2, 1), (1000, 999)])
def test_sample_indices_follow_the_rule_element_by_element(numel, samples):
    # The vectorized draw must give the positions the rule gives (recorded baselines hold values at
    # them), also where the first 2 * samples draws hold too few distinct values (numel near samples).
    for path in ("layer:model.dec_layers.0.ffn_layer.ffn.0", "grad.w", "x"):
        got = sample_indices(path, numel, samples)
        assert got.dtype == torch.int64 and got.tolist() == _first_distinct(path, numel, samples)


def test_sample_indices_follow_the_rule_on_both_paths_over_many_sizes():
    # Sizes from just above the sample count (the first draws repeat: the general path) to large
    # layers (the first ``samples`` draws are distinct: the sorted-head path), each against the rule.
    import numpy as np

    sizes = np.unique(np.geomspace(65, 5e7, 300).astype(int)).tolist()
    for numel in sizes:
        for path in ("layer:model.dec_layers.0.ffn_layer.ffn.0", "layer:encoder.layer.3.output.dense@in"):
            assert sample_indices(path, numel, 64).tolist() == _first_distinct(path, numel, 64), (path, numel)


def test_train_store_specs():
    assert parse_train_store(None, source="ini") == TrainStore()
    assert parse_train_store("full", source="ini").mode == "full"
    store = parse_train_store("summary min_numel=1000 samples=100 # small repo", source="ini")
    assert (store.mode, store.min_numel, store.samples, store.source) == ("summary", 1000, 100, "ini")
    assert parse_train_store("summary", source="marker") == TrainStore("summary", DEFAULT_MIN_NUMEL, DEFAULT_SAMPLES,
                                                                       "marker")
    for bad, message in (("sumary", "use one of full, summary"), ("summary min=5", "unknown setting 'min=5'"),
                         ("summary samples=x", "samples='x' is not an integer"),
                         ("summary min_numel=10 samples=10", "samples=10 must be smaller than min_numel=10"),
                         ("full samples=3", "'full' takes no settings"), ("summary samples=0", "positive integer")):
        with pytest.raises(ValueError, match=message):
            parse_train_store(bad, source="ini")


def test_leaf_stats_are_float64_accurate_and_order_sensitive():
    t = torch.randn(300, 7, generator=torch.Generator().manual_seed(0))
    stats = leaf_stats(t)
    d = t.double()
    assert stats.dtype == torch.float32
    assert stats[:3].tolist() == pytest.approx([float(d.sum()), float(d.norm()), float(d.abs().max())], rel=1e-6)
    swapped = t.flip(0)  # the same values in another order: only the position-weighted sum moves
    assert torch.equal(leaf_stats(swapped)[1:3], stats[1:3]) and leaf_stats(swapped)[3] != stats[3]
    assert leaf_stats(t.double()).dtype == torch.float64


def test_compact_leaves_keeps_small_leaves_and_reduces_others_the_same_way_each_time():
    g = torch.Generator().manual_seed(1)
    leaves = {"loss": torch.tensor(0.5), "grad.w": torch.randn(50, 40, generator=g), "grad.b": torch.randn(40, generator=g),
              "param.w": torch.randn(50, 40, generator=g), "buffer.running_mean": torch.randn(2000, generator=g),
              "grad.none": None}
    store = TrainStore("summary", min_numel=1000, samples=64)
    out, compact = compact_leaves(leaves, store)
    assert list(out) == ["loss", "grad.w@sample", "grad.w@stats", "grad.b", "param.w@sample", "param.w@stats",
                         "buffer.running_mean", "grad.none"]
    assert compact == {"grad.w": {"numel": 2000, "shape": [50, 40], "dtype": "float32", "samples": 64},
                       "param.w": {"numel": 2000, "shape": [50, 40], "dtype": "float32", "samples": 64}}
    index = sample_indices("grad.w", 2000, 64)
    assert torch.equal(out["grad.w@sample"], leaves["grad.w"].reshape(-1)[index])
    again = apply_recorded(leaves, compact)  # the target's full leaves, reduced as recorded
    assert again.keys() == out.keys() and all(
        (a is None and b is None) or torch.equal(a, b) for a, b in zip(again.values(), out.values()))
    assert compact_leaves(leaves, TrainStore()) == (leaves, {})
    # a leaf whose size changed is left whole: the comparison reports the change
    resized = dict(leaves, **{"grad.w": torch.zeros(10)})
    assert "grad.w" in apply_recorded(resized, compact)


def test_rounding_noise_parameters_are_found_in_compact_leaves_too():
    leaves = {"grad.w": torch.full((2000,), 0.5), "grad.b": torch.full((2000,), 1e-9),
              "param.w": torch.ones(2000), "param.b": torch.ones(2000)}
    full = rounding_level_params(leaves)
    compacted, _ = compact_leaves(leaves, TrainStore("summary", min_numel=1000, samples=16))
    assert full == {"param.b"}
    assert rounding_level_params(compacted) == {"param.b@sample", "param.b@stats"}


# --------------------------------------------------------------------------------------------
# through the runner: record compact, compare, fail on a fault


class ConvNet(torch.nn.Module):
    """A conv (with a bias: rounding-noise gradient under the BatchNorm), BatchNorm, linear head."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 16, 3)
        self.bn = torch.nn.BatchNorm2d(16)
        self.fc = torch.nn.Linear(16 * 6 * 6, 10)

    def forward(self, x, labels):
        h = torch.relu(self.bn(self.conv(x))).flatten(1)
        return torch.nn.functional.cross_entropy(self.fc(h), labels)


def _inputs() -> dict:
    g = torch.Generator().manual_seed(2)
    return {"x": torch.randn(4, 3, 8, 8, generator=g), "labels": torch.tensor([1, 3, 5, 7])}


_TAG = "_compact_test_fault"


@contextlib.contextmanager
def _scaled_in_the_copy(factor: float) -> Iterator[None]:
    """The target's own copy of the model has parameter ``<tag>`` × ``factor`` (a train step deep-copies
    the module before the patch set is entered, so the fault is applied at its first forward)."""
    done = set()

    def pre_hook(module, _args):
        name = getattr(module, _TAG, None)
        if name is not None and id(module) not in done:
            done.add(id(module))
            with torch.no_grad():
                module.get_parameter(name).mul_(factor)
    handle = torch.nn.modules.module.register_module_forward_pre_hook(pre_hook)
    try:
        yield
    finally:
        handle.remove()


def _record(store, model, train_store, test_id="tests/t.py::test_step[fp32]") -> None:
    session = ParitySession(torch.device("cpu"), reference="cpu", update_baselines=True, store=store,
                            train_store=train_store)
    case = ParityCase(session, test_id)
    case.train_step("step", model, _inputs())
    assert case.finish() == "created"


def _compare(store, model, patches=None, policy="golden", test_id="tests/t.py::test_step[fp32]"):
    session = ParitySession(torch.device("cpu"), reference="baseline", store=store)
    case = ParityCase(session, test_id, patches=patches)
    return case, case.train_step("step", model, _inputs(), policy=policy)


@pytest.mark.parametrize("policy", ["golden", "allclose"])
def test_a_compact_baseline_is_small_passes_clean_and_fails_a_1e_4_fault(tmp_path, policy):
    torch.manual_seed(0)
    model = ConvNet()
    full, summary = BaselineStore(tmp_path / "full", "t"), BaselineStore(tmp_path / "summary", "t")
    _record(full, model, "full")
    _record(summary, model, "summary min_numel=1000 samples=64")
    size = {name: store.path_for("tests/t.py::test_step[fp32]").stat().st_size
            for name, store in (("full", full), ("summary", summary))}
    assert size["summary"] < size["full"] / 2  # fc.weight (5760 elements) and its gradient: 64 values each
    baseline = summary.load("tests/t.py::test_step[fp32]")
    assert baseline.checks["step"].meta["compact"]["param.fc.weight"]["samples"] == 64
    assert "param.fc.weight@sample" in baseline.checks["step"].tensors

    _, record = _compare(summary, model, policy=policy)  # the clean target passes
    leaves = {leaf.path for leaf in record.result.leaves}
    assert {"grad.fc.weight@sample", "grad.fc.weight@stats", "grad.conv.weight"} <= leaves
    # rounding-noise gradient under the BatchNorm: compared with the optimizer replay from the target's
    # gradients (validated on the leaves the baseline stores whole), not dropped
    assert "param.conv.bias" in leaves and "param.fc.weight@stats" in leaves
    assert "train store summary" in record.extra["policy_note"]
    assert "(optimizer replay)" in record.extra["policy_note"]

    setattr(model, _TAG, "fc.weight")
    failing = {}
    try:
        for name, store in (("full", full), ("summary", summary)):  # the fault fails both baselines alike
            with pytest.raises(ParityError) as info:
                _compare(store, model, patches=lambda device: _scaled_in_the_copy(1 + 1e-4), policy=policy)
            failing[name] = {base_leaf(leaf.path) for leaf in info.value.result.leaves if not leaf.passed}
    finally:
        delattr(model, _TAG)
    assert failing["summary"] >= failing["full"]  # a compact baseline misses nothing the full one sees
    if policy == "golden":  # the golden sees the fault in the compacted leaves themselves
        assert {"grad.fc.weight", "param.fc.weight"} <= failing["summary"], failing
    else:
        # allclose 1e-5 sees it in the loss only, elementwise (|Δw| = 1e-4·|w| < atol: a damped
        # fault); the @stats leaf's L2 norm of the whole weight (≈ 1.3, moved by 1e-4 relative) sees it
        assert failing == {"full": {"loss"}, "summary": {"loss", "param.fc.weight"}}


def test_the_marker_and_argument_choose_the_store_and_a_comparison_follows_the_recording(tmp_path):
    torch.manual_seed(0)
    model = ConvNet()
    store = BaselineStore(tmp_path, "t")
    session = ParitySession(torch.device("cpu"), reference="cpu", update_baselines=True, store=store)
    case = ParityCase(session, "tests/t.py::test_m[fp32]", marker_train_store="summary min_numel=1000 samples=32")
    case.train_step("step", model, _inputs())
    case.train_step("full_step", model, _inputs(), store="full")
    case.finish()
    checks = store.load("tests/t.py::test_m[fp32]").checks
    assert checks["step"].meta["train_store"] == "summary min_numel=1000 samples=32"
    assert "param.fc.weight" in checks["full_step"].tensors and "compact" not in checks["full_step"].meta
    # compared by a session whose own setting is full: the baseline says how it was recorded
    compare = ParitySession(torch.device("cpu"), reference="baseline", store=store, train_store="full")
    case = ParityCase(compare, "tests/t.py::test_m[fp32]")
    record = case.train_step("step", model, _inputs())
    assert any(leaf.path == "param.fc.weight@sample" for leaf in record.result.leaves)
    with pytest.raises(ValueError, match="train store 'smry'"):
        ParityCase(compare, "tests/t.py::test_x[fp32]", marker_train_store="smry")


def test_re_runs_of_a_compact_comparison_are_reduced_like_the_baseline(tmp_path):
    """What --parity-selfcheck and other check hooks re-run is compared with the compact leaves."""
    from pytest_npu_parity.selfcheck import SelfCheck

    torch.manual_seed(0)
    model = ConvNet()
    store = BaselineStore(tmp_path, "t")
    _record(store, model, "summary min_numel=1000 samples=64")
    seen = {}

    def hook(case, record, call, actual, expected):
        seen["rerun"] = set(call.rerun(torch.device("cpu"), True, call.args, call.kwargs))
        seen["actual"], seen["expected"] = set(actual), set(expected)
    session = ParitySession(torch.device("cpu"), reference="baseline", store=store, check_hooks=[hook, SelfCheck()])
    record = ParityCase(session, "tests/t.py::test_step[fp32]").train_step("step", model, _inputs(),
                                                                        policy="allclose")
    assert seen["rerun"] >= seen["actual"] == seen["expected"] and "grad.fc.weight@sample" in seen["rerun"]
    assert "grad.fc.weight" not in seen["rerun"]
    assert record.extra["teeth"] and record.extra["selfcheck"]["weight"]["caught"]
