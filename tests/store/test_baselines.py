"""Tests for pytest_npu_parity.baselines: layout, round-trip, freshness, corruption, pickle refusal,
atomic and concurrent writes, unused detection."""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from locations import REPO
from safetensors import safe_open

from pytest_npu_parity import baselines as bl
from pytest_npu_parity.store import baselines as store_baselines
from pytest_npu_parity.store import reading as store_reading
from pytest_npu_parity.baselines import (
    Baseline,
    BaselineError,
    BaselineStore,
    CheckBaseline,
    CorruptBaselineError,
    MissingBaselineError,
    StaleBaselineError,
    SuiteStores,
    UnsafeBaselineError,
)

TEST_ID = "parity_suites/aurora/test_layers.py::test_decoder_layer[bf16-batch]"
PROV = {"device_type": "cuda", "device_name": "NVIDIA H200", "created": "2026-11-30T09:27:05+00:00",
        "torch": "2.14.1", "recipe": "bf16", "git_revision": "ab12cd34ef00"}


@pytest.fixture
def store(tmp_path):
    return BaselineStore(tmp_path / "baselines", "aurora")


def make_checks(seed: int = 0, *, input_hash: str = "in-0", config_hash: str = "cfg-0") -> dict[str, CheckBaseline]:
    g = torch.Generator().manual_seed(seed)
    dec = CheckBaseline(
        name="dec_layer_0",
        tensors={"[0]": torch.randn(2, 3, 8, generator=g).to(torch.bfloat16),
                 "[1]": torch.randn(2, 3, generator=g)},
        none_leaves=["[2]"],
        meta={"input_hash": input_hash, "config_hash": config_hash, "submodule": "model.dec_layers.0"},
    )
    model = CheckBaseline(
        name="model",
        tensors={"last_hidden_state": torch.randn(4, 5, generator=g), "": torch.arange(3)},
        none_leaves=[],
        meta={"input_hash": input_hash, "config_hash": config_hash},
    )
    return {"dec_layer_0": dec, "model": model}


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern of a tensor, for bit-exact comparisons (NaN payloads and -0.0 included)."""
    t = t.contiguous()
    return t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else (
        t.view(torch.int32) if t.dtype == torch.float32 else t)


def assert_same_checks(got: dict[str, CheckBaseline], want: dict[str, CheckBaseline]) -> None:
    assert set(got) == set(want)
    for name, check in want.items():
        loaded = got[name]
        assert set(loaded.tensors) == set(check.tensors)
        for leaf, tensor in check.tensors.items():
            assert loaded.tensors[leaf].dtype == tensor.dtype, (name, leaf)
            assert loaded.tensors[leaf].shape == tensor.shape, (name, leaf)
            assert torch.equal(bits(loaded.tensors[leaf]), bits(tensor)), (name, leaf)
        assert loaded.none_leaves == sorted(check.none_leaves)


# --------------------------------------------------------------------------------------------
# create -> load -> fresh


def test_create_load_fresh_round_trip(store):
    checks = make_checks()
    assert store.write(TEST_ID, checks, PROV) == "created"
    path = store.path_for(TEST_ID)
    assert path == store.root / "aurora" / "parity_suites" / "aurora" / "test_layers" / \
        "test_decoder_layer.bf16-batch.safetensors"
    assert path.is_file()

    baseline = store.load(TEST_ID)
    assert isinstance(baseline, Baseline)
    assert baseline.path == path and baseline.test_id == TEST_ID
    assert baseline.provenance == PROV
    assert_same_checks(baseline.checks, checks)
    entry = store.check_fresh(baseline, "dec_layer_0", input_hash="in-0", config_hash="cfg-0",
                              shapes={"[0]": (2, 3, 8), "[1]": (2, 3), "[2]": None})
    assert entry.meta["submodule"] == "model.dec_layers.0"
    assert entry.meta["shapes"] == {"[0]": [2, 3, 8], "[1]": [2, 3]}
    assert entry.meta["dtypes"] == {"[0]": "bfloat16", "[1]": "float32"}


def test_file_is_plain_safetensors_with_documented_keys(store):
    store.write(TEST_ID, make_checks(), PROV)
    with safe_open(str(store.path_for(TEST_ID)), framework="pt") as fh:
        keys = set(fh.keys())
        meta = fh.metadata()
    assert keys == {"dec_layer_0/[0]", "dec_layer_0/[1]", "model/last_hidden_state", "model"}
    assert meta["format"] == bl.FORMAT and meta["format_version"] == str(bl.FORMAT_VERSION)
    assert meta["test_id"] == TEST_ID
    assert json.loads(meta["provenance"]) == PROV
    assert json.loads(meta["checks"])["dec_layer_0"]["none_leaves"] == ["[2]"]


def test_bf16_special_values_round_trip_bit_exact(store):
    raw = torch.tensor([0x7FC1, 0xFF80, 0x7F80, 0x0001, 0x8000, 0x3F80, 0xC0490], dtype=torch.int32)
    special = (raw & 0xFFFF).to(torch.int16).view(torch.bfloat16)  # NaN payload, ±inf, subnormal, -0
    checks = {"c": CheckBaseline("c", {"x": special, "f": torch.tensor([-0.0, float("nan")])}, [], {})}
    store.write("t.py::t", checks, {})
    assert_same_checks(store.load("t.py::t").checks, checks)


def test_tensors_are_stored_as_cpu_copies(store):
    source = torch.randn(3, 4, requires_grad=True)
    view = source.t()  # non-contiguous, requires grad
    store.write("t.py::t", {"c": CheckBaseline("c", {"x": view}, [], {})}, {})
    loaded = store.load("t.py::t").checks["c"].tensors["x"]
    assert loaded.device.type == "cpu" and not loaded.requires_grad
    assert torch.equal(loaded, view.detach())


def test_absent_baseline_loads_as_none_and_require_gives_the_command(store):
    assert store.load("parity_suites/aurora/test_x.py::test_y[fp32]") is None
    with pytest.raises(MissingBaselineError) as info:
        store.require("parity_suites/aurora/test_x.py::test_y[fp32]")
    text = str(info.value)
    assert "pytest --update-baselines 'parity_suites/aurora/test_x.py::test_y[fp32]'" in text
    assert "test_y.fp32.safetensors" in text
    assert info.value.path == store.path_for("parity_suites/aurora/test_x.py::test_y[fp32]")


def test_missing_check_in_file(store):
    store.write(TEST_ID, make_checks(), PROV)
    baseline = store.load(TEST_ID)
    with pytest.raises(MissingBaselineError) as info:
        store.check_fresh(baseline, "encoder", input_hash="in-0", config_hash="cfg-0")
    text = str(info.value)
    assert "'encoder'" in text and "dec_layer_0, model" in text
    assert f"pytest --update-baselines '{TEST_ID}'" in text
    assert "NVIDIA H200" in text and "2026-11-30" in text


# --------------------------------------------------------------------------------------------
# stale


def test_changed_input_hash_is_stale_with_reason(store):
    store.write(TEST_ID, make_checks(input_hash="aaaa1111"), PROV)
    baseline = store.load(TEST_ID)
    with pytest.raises(StaleBaselineError) as info:
        store.check_fresh(baseline, "dec_layer_0", input_hash="bbbb2222", config_hash="cfg-0")
    text = str(info.value)
    assert "input hash changed (recorded aaaa1111, now bbbb2222)" in text
    assert "config hash" not in text
    assert "test_decoder_layer.bf16-batch.safetensors" in text
    assert "cuda (NVIDIA H200) · 2026-11-30 · torch 2.14.1" in text  # which baseline
    assert f"pytest --update-baselines '{TEST_ID}'" in text


def test_changed_config_hash_is_stale(store):
    store.write(TEST_ID, make_checks(), PROV)
    with pytest.raises(StaleBaselineError, match=r"weights changed .*model fingerprint recorded cfg-0, now cfg-1"):
        store.check_fresh(store.load(TEST_ID), "model", input_hash="in-0", config_hash="cfg-1")


def test_changed_weights_are_stale_naming_the_tensors_and_never_close_enough(store):
    """Weights are bitwise reproducible: one ULP on one weight is another model, named in full."""
    from pytest_npu_parity.provenance import fingerprint_module, module_tensor_digests

    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    checks = make_checks(config_hash=fingerprint_module(layer))
    checks["dec_layer_0"].meta["config_tensors"] = module_tensor_digests(layer)
    store.write(TEST_ID, checks, PROV)
    with torch.no_grad():
        layer[1].weight[0, 0] = torch.nextafter(layer[1].weight[0, 0], torch.tensor(9.0))
    with pytest.raises(StaleBaselineError) as info:
        store.check_fresh(store.load(TEST_ID), "dec_layer_0", input_hash="in-0",
                          config_hash=fingerprint_module(layer), config_tensors=lambda: module_tensor_digests(layer))
    assert "weights changed (1 of 4 tensors differ, e.g. 'model.dec_layers.0.1.weight')" in str(info.value)


def _with_structure(checks: dict[str, CheckBaseline], module: torch.nn.Module) -> dict[str, CheckBaseline]:
    from pytest_npu_parity.structure import module_structure, pack_structure, structure_hash

    record = module_structure(module)
    for check in checks.values():
        check.meta.update(structure_hash=structure_hash(record), structure=pack_structure(record))
    return checks


def _structure(module: torch.nn.Module) -> dict:
    from pytest_npu_parity.structure import module_structure, structure_hash

    record = module_structure(module)
    return {"structure_hash": structure_hash(record), "structure": record}


def test_a_changed_configuration_is_stale_naming_what_changed(store):
    store.write(TEST_ID, _with_structure(make_checks(), torch.nn.LayerNorm(8, eps=1e-5)), PROV)
    baseline = store.load(TEST_ID)
    assert store.check_fresh(baseline, "model", input_hash="in-0", config_hash="cfg-0",
                             **_structure(torch.nn.LayerNorm(8))).meta["bitwise_structure"] is True
    with pytest.raises(StaleBaselineError) as info:
        store.check_fresh(baseline, "dec_layer_0", input_hash="in-0", config_hash="cfg-0",
                          **_structure(torch.nn.LayerNorm(8, eps=1e-3)))
    text = str(info.value)
    assert ("is stale for check 'dec_layer_0': structure changed (1 of 1 modules differ, e.g. 'model.dec_layers.0': "
            "eps 1e-05 → 0.001). It was recorded on cuda (NVIDIA H200)") in text  # named as in the whole model
    assert info.value.structure_changed is True
    assert f"pytest --update-baselines '{TEST_ID}'" in text
    # the weights' fingerprint is the same: weights are not blamed
    assert "weights changed" not in text


def test_a_structure_difference_in_fields_one_side_lacks_is_fresh(store):
    store.write(TEST_ID, _with_structure(make_checks(), torch.nn.Linear(4, 2)), PROV)
    now = _structure(torch.nn.Linear(4, 2))
    now["structure"]["modules"][""][1]["added_by_a_newer_torch"] = 1
    from pytest_npu_parity.structure import structure_hash

    now["structure_hash"] = structure_hash(now["structure"])
    entry = store.check_fresh(store.load(TEST_ID), "model", input_hash="in-0", config_hash="cfg-0", **now)
    assert entry.meta["bitwise_structure"] is False


def test_a_baseline_without_a_recorded_structure_makes_no_claim(store):
    store.write(TEST_ID, make_checks(), PROV)  # recorded before the structure existed
    entry = store.check_fresh(store.load(TEST_ID), "model", input_hash="in-0", config_hash="cfg-0",
                              **_structure(torch.nn.LayerNorm(8, eps=1e-3)))
    assert "bitwise_structure" not in entry.meta
    # and a function (no structure now) against a recorded one makes none either
    store.write(TEST_ID, _with_structure(make_checks(), torch.nn.LayerNorm(8)), PROV)
    store.check_fresh(store.load(TEST_ID), "model", input_hash="in-0", config_hash="cfg-0",
                      structure_hash=None, structure=None)


def test_an_unreadable_recorded_structure_is_stale(store):
    checks = _with_structure(make_checks(), torch.nn.LayerNorm(8))
    checks["model"].meta["structure"] = "not a record"
    store.write(TEST_ID, checks, PROV)
    with pytest.raises(StaleBaselineError, match=r"structure changed \(the recorded structure cannot be compared"):
        store.check_fresh(store.load(TEST_ID), "model", input_hash="in-0", config_hash="cfg-0",
                          **_structure(torch.nn.LayerNorm(8, eps=1e-3)))


def test_changed_shape_is_stale_naming_leaf_and_shapes(store):
    store.write(TEST_ID, make_checks(), PROV)
    baseline = store.load(TEST_ID)
    with pytest.raises(StaleBaselineError) as info:
        store.check_fresh(baseline, "dec_layer_0", input_hash="in-0", config_hash="cfg-0",
                          shapes={"[0]": (2, 4, 8), "[1]": (2, 3), "[2]": None})
    text = str(info.value)
    assert "shape of output '[0]' changed (recorded (2, 3, 8), now (2, 4, 8))" in text
    assert "'[1]'" not in text and "hash" not in text


def test_added_removed_and_none_leaves_are_stale(store):
    store.write(TEST_ID, make_checks(), PROV)
    baseline = store.load(TEST_ID)
    with pytest.raises(StaleBaselineError) as info:
        store.check_fresh(baseline, "dec_layer_0", input_hash="in-0", config_hash="cfg-0",
                          shapes={"[0]": (2, 3, 8), "[2]": (1,), "[3]": (1,)})
    text = str(info.value)
    assert "output '[1]' was recorded but is no longer produced" in text
    assert "shape of output '[2]' changed (recorded None, now (1,))" in text
    assert "output '[3]' is new" in text


def test_changed_dtype_is_stale(store):
    store.write(TEST_ID, make_checks(), PROV)
    baseline = store.load(TEST_ID)
    store.check_fresh(baseline, "dec_layer_0", input_hash="in-0", config_hash="cfg-0",
                      dtypes={"[0]": torch.bfloat16, "[1]": "float32"})
    with pytest.raises(StaleBaselineError, match=r"dtype of output '\[0\]' changed \(recorded bfloat16, now float32\)"):
        store.check_fresh(baseline, "dec_layer_0", input_hash="in-0", config_hash="cfg-0",
                          dtypes={"[0]": torch.float32, "[1]": torch.float32})


# --------------------------------------------------------------------------------------------
# corrupt and unsafe files


@pytest.mark.parametrize("keep", ["4 bytes", "12 bytes", "half the header", "all but one byte"])
def test_truncated_file_is_corrupt_naming_it(store, keep):
    store.write(TEST_ID, make_checks(), PROV)
    path = store.path_for(TEST_ID)
    data = path.read_bytes()
    header = int.from_bytes(data[:8], "little")
    size = {"4 bytes": 4, "12 bytes": 12, "half the header": 8 + header // 2, "all but one byte": len(data) - 1}[keep]
    path.write_bytes(data[:size])
    with pytest.raises(CorruptBaselineError) as info:
        store.load(TEST_ID)
    assert path.name in str(info.value)
    assert info.value.path == path


@pytest.mark.parametrize("content", [b"", os.urandom(4096), b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!"],
                         ids=["empty", "random", "bad-header"])
def test_garbage_is_corrupt(store, content):
    path = store.path_for(TEST_ID)
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    with pytest.raises(CorruptBaselineError, match=path.name.replace(".", r"\.")):
        store.load(TEST_ID)


def test_flipped_bit_in_tensor_data_fails_the_checksum(store):
    store.write(TEST_ID, make_checks(), PROV)
    path = store.path_for(TEST_ID)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # inside the last tensor's bytes: safetensors alone cannot notice
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptBaselineError, match="checksum") as info:
        store.load(TEST_ID)
    assert path.name in str(info.value)


def test_foreign_safetensors_file_is_refused(store):
    from safetensors.torch import save_file

    path = store.path_for(TEST_ID)
    path.parent.mkdir(parents=True)
    save_file({"weight": torch.ones(2)}, str(path))
    with pytest.raises(CorruptBaselineError, match="not a pytest-npu-parity-baseline file"):
        store.load(TEST_ID)


def test_newer_format_version_is_refused(store, monkeypatch):
    monkeypatch.setattr(store_baselines, "FORMAT_VERSION", 99)  # the writer's version
    store.write(TEST_ID, make_checks(), PROV)
    monkeypatch.setattr(store_reading, "FORMAT_VERSION", 1)  # the reader's
    with pytest.raises(BaselineError, match="format version 99.*upgrade"):
        store.load(TEST_ID)


class _Trap:
    """Unpickling this creates the directory ``marker``: a visible side effect of any unpickling."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_torch_save_file_beside_the_baseline_is_refused_never_unpickled(store, tmp_path):
    marker = tmp_path / "unpickled"
    path = store.path_for(TEST_ID)
    path.parent.mkdir(parents=True)
    pt = path.with_suffix(".pt")
    torch.save({"logits": _Trap(marker)}, pt)

    with pytest.raises(UnsafeBaselineError) as info:
        store.load(TEST_ID)
    assert pt.name in str(info.value)
    assert store.scan_unsafe() == [pt]
    assert not marker.exists()

    # the trap is real: loading it the unsafe way would have run code
    torch.load(pt, weights_only=False)
    assert marker.is_dir()


@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_pickle_under_the_baseline_name_is_refused(store, tmp_path, protocol):
    marker = tmp_path / "unpickled"
    path = store.path_for(TEST_ID)
    path.parent.mkdir(parents=True)
    path.write_bytes(pickle.dumps(_Trap(marker), protocol=protocol))

    with pytest.raises(UnsafeBaselineError, match=path.name.replace(".", r"\.")):
        store.load(TEST_ID)
    assert store.scan_unsafe() == [path]
    assert not marker.exists()
    # write() replaces it without ever reading it as a pickle
    assert store.write(TEST_ID, make_checks(), PROV) == "changed"
    assert not marker.exists()
    assert store.load(TEST_ID) is not None

    pickle.loads(pickle.dumps(_Trap(marker), protocol=protocol))
    assert marker.is_dir()


def test_scan_unsafe_finds_pickle_suffixes_anywhere(store):
    store.write(TEST_ID, make_checks(), PROV)
    deep = store.suite_dir / "a" / "b"
    deep.mkdir(parents=True)
    for name in ("w.pth", "x.bin", "y.pkl", "z.ckpt"):
        (deep / name).write_bytes(b"anything")
    assert [p.name for p in store.scan_unsafe()] == ["w.pth", "x.bin", "y.pkl", "z.ckpt"]


# --------------------------------------------------------------------------------------------
# writes: unchanged, atomic, concurrent


def test_unchanged_write_does_not_touch_the_file(store):
    checks = make_checks()
    checks["dec_layer_0"].tensors["nan"] = torch.tensor([float("nan"), 1.0])
    assert store.write(TEST_ID, checks, PROV) == "created"
    path = store.path_for(TEST_ID)
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    before = (path.read_bytes(), path.stat().st_mtime_ns, path.stat().st_ino)

    later = {**PROV, "created": "2027-01-01T00:00:00+00:00"}
    assert store.write(TEST_ID, make_checks() | {"dec_layer_0": checks["dec_layer_0"]}, later) == "unchanged"
    assert (path.read_bytes(), path.stat().st_mtime_ns, path.stat().st_ino) == before
    assert store.load(TEST_ID).provenance["created"] == PROV["created"]  # no date churn


def test_changed_tensor_meta_or_check_set_is_rewritten(store):
    store.write(TEST_ID, make_checks(), PROV)
    path = store.path_for(TEST_ID)

    checks = make_checks()
    t = checks["model"].tensors["last_hidden_state"]
    t[0, 0] = torch.nextafter(t[0, 0], torch.tensor(1e9))  # one ulp
    assert store.write(TEST_ID, checks, PROV) == "changed"
    assert torch.equal(store.load(TEST_ID).checks["model"].tensors["last_hidden_state"], t)

    assert store.write(TEST_ID, make_checks(input_hash="in-9"), PROV) == "changed"
    assert store.load(TEST_ID).checks["model"].meta["input_hash"] == "in-9"

    zero = {"c": CheckBaseline("c", {"x": torch.tensor([0.0])}, [], {})}
    store.write(TEST_ID, zero, PROV)
    assert store.write(TEST_ID, {"c": CheckBaseline("c", {"x": torch.tensor([-0.0])}, [], {})}, PROV) == "changed"
    assert store.write(TEST_ID, {"c": CheckBaseline("c", {"x": torch.tensor([-0.0])}, ["y"], {})}, PROV) == "changed"

    only_model = {"model": make_checks()["model"]}
    assert store.write(TEST_ID, only_model, PROV) == "changed"
    assert set(store.load(TEST_ID).checks) == {"model"}
    assert path.is_file()


def test_write_heals_a_corrupt_file(store):
    path = store.path_for(TEST_ID)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"garbage")
    assert store.write(TEST_ID, make_checks(), PROV) == "changed"
    assert_same_checks(store.load(TEST_ID).checks, make_checks())


def _litter(directory: Path, keep: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p != keep)


@pytest.mark.parametrize("crash_in", ["replace", "fsync"])
def test_interrupted_write_leaves_old_baseline_and_no_temp_files(store, monkeypatch, crash_in):
    store.write(TEST_ID, make_checks(0), PROV)
    path = store.path_for(TEST_ID)
    old_bytes = path.read_bytes()

    def crash(*args, **kwargs):
        raise OSError(f"simulated crash in os.{crash_in}")

    monkeypatch.setattr(os, crash_in, crash)
    with pytest.raises(OSError, match="simulated crash"):
        store.write(TEST_ID, make_checks(1), PROV)
    monkeypatch.undo()

    assert path.read_bytes() == old_bytes
    assert _litter(path.parent, path) == []
    assert_same_checks(store.load(TEST_ID).checks, make_checks(0))


def test_interrupted_first_write_leaves_nothing(store, monkeypatch):
    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        store.write(TEST_ID, make_checks(), PROV)
    monkeypatch.undo()
    path = store.path_for(TEST_ID)
    assert not path.exists() and _litter(path.parent, path) == []
    assert store.load(TEST_ID) is None


_WRITER = r"""
import sys, torch
from pytest_npu_parity.baselines import BaselineStore, CheckBaseline
root, version, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
store = BaselineStore(root, "aurora")
n = 200_000
checks = {
    "a": CheckBaseline("a", {"x": torch.full((n,), float(version)), "y": torch.full((n,), version, dtype=torch.bfloat16)},
                       [], {"input_hash": f"in-{version}", "config_hash": "c"}),
    "b": CheckBaseline("b", {"z": torch.full((n // 2,), -float(version))}, [], {"input_hash": f"in-{version}", "config_hash": "c"}),
}
for i in range(rounds):
    store.write(sys.argv[4], checks, {"writer": version, "round": i})
"""


def _assert_one_complete_version(baseline: Baseline) -> int:
    version = int(baseline.provenance["writer"])
    a, b = baseline.checks["a"], baseline.checks["b"]
    assert a.meta["input_hash"] == b.meta["input_hash"] == f"in-{version}"
    assert torch.all(a.tensors["x"] == version) and torch.all(a.tensors["y"] == version)
    assert torch.all(b.tensors["z"] == -version)
    return version


def test_concurrent_writers_never_leave_a_mixed_or_partial_file(store):
    processes = 3
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen([sys.executable, "-c", _WRITER, str(store.root), str(v), "12", TEST_ID],
                         env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for v in range(1, processes + 1)
    ]
    seen: set[int] = set()
    reads = 0
    while any(p.poll() is None for p in procs):
        baseline = store.load(TEST_ID)
        if baseline is not None:
            seen.add(_assert_one_complete_version(baseline))
            reads += 1
    for p in procs:
        _, err = p.communicate()
        assert p.returncode == 0, err.decode()
    final = store.load(TEST_ID)
    seen.add(_assert_one_complete_version(final))
    assert seen <= {1, 2, 3} and reads > 0
    path = store.path_for(TEST_ID)
    assert _litter(path.parent, path) == []


# --------------------------------------------------------------------------------------------
# unused and prune


def test_unused_lists_files_no_test_used_and_prune_removes_them(store):
    ids = ["parity_suites/aurora/test_a.py::t1", "parity_suites/aurora/test_a.py::t2",
           "parity_suites/aurora/sub/test_b.py::t3[fp32]"]
    for test_id in ids:
        store.write(test_id, make_checks(), PROV)
    temp = store.path_for(ids[0]).parent / ".t1.safetensors.abc123.tmp"
    temp.write_bytes(b"half-written")  # what a killed writer leaves
    used = {store.path_for(ids[0]), store.path_for(ids[1])}

    stale = store.path_for(ids[2])
    assert store.unused(used) == [stale]
    store.prune(store.unused(used))
    assert not stale.exists() and not stale.parent.exists()  # emptied directories go too
    assert all(store.path_for(i).exists() for i in ids[:2])
    assert store.unused(used) == []


def test_prune_refuses_paths_outside_the_store(store, tmp_path):
    store.write(TEST_ID, make_checks(), PROV)
    outside = tmp_path / "precious.safetensors"
    outside.write_bytes(b"x")
    with pytest.raises(BaselineError, match="outside"):
        store.prune([store.path_for(TEST_ID), outside])
    assert outside.exists() and store.path_for(TEST_ID).exists()
    with pytest.raises(BaselineError, match="not a .safetensors"):
        store.prune([store.suite_dir / "notes.txt"])


# --------------------------------------------------------------------------------------------
# file names from test ids


def test_layout_with_class_and_params(store):
    root = store.suite_dir
    assert store.path_for("parity_suites/aurora/test_model.py::TestTrain::test_step[fp32]") == \
        root / "parity_suites" / "aurora" / "test_model" / "TestTrain+test_step.fp32.safetensors"
    assert store.path_for("test_top.py::test_plain") == root / "test_top" / "test_plain.safetensors"


def test_module_prefix_is_dropped(tmp_path):
    store = BaselineStore(tmp_path, "aurora", module_prefix="parity_suites/aurora")
    assert store.path_for(TEST_ID) == tmp_path.resolve() / "aurora" / "test_layers" / \
        "test_decoder_layer.bf16-batch.safetensors"
    with pytest.raises(BaselineError, match=r"not under parity_suites/aurora/.*use SuiteStores"):
        store.path_for("other/test_x.py::t")  # it could share a file with parity_suites/aurora/other/test_x.py::t


def test_suite_stores_route_by_suite(tmp_path):
    stores = SuiteStores(tmp_path)
    assert SuiteStores.suite_of(TEST_ID) == ("aurora", "parity_suites/aurora")
    assert SuiteStores.suite_of("tests/test_x.py::t") == ("_rootdir", "")
    assert SuiteStores.suite_of("test_x.py::t") == ("_rootdir", "")
    assert stores.path_for("tests/test_x.py::t") == tmp_path.resolve() / "_rootdir" / "tests" / "test_x" / "t.safetensors"
    assert stores.path_for(TEST_ID) == tmp_path.resolve() / "aurora" / "test_layers" / \
        "test_decoder_layer.bf16-batch.safetensors"
    other = "parity_suites/bert/test_enc.py::test_e[fp32]"
    assert stores.write(TEST_ID, make_checks(), PROV) == "created"
    assert stores.write(other, make_checks(1), PROV) == "created"
    assert stores.path_for(other) == tmp_path.resolve() / "bert" / "test_enc" / "test_e.fp32.safetensors"
    baseline = stores.load(TEST_ID)
    stores.check_fresh(baseline, "model", input_hash="in-0", config_hash="cfg-0")
    with pytest.raises(StaleBaselineError, match=r"--update-baselines 'parity_suites/aurora/test_layers\.py"):
        stores.check_fresh(baseline, "model", input_hash="in-1", config_hash="cfg-0")
    assert stores.unused({stores.path_for(TEST_ID)}) == [stores.path_for(other)]
    with pytest.raises(MissingBaselineError):
        stores.require("parity_suites/aurora/test_new.py::t")


@pytest.mark.parametrize("params", [("a/b", "a_b"), ("a b", "a_b"), ("x.y", "x_y"), ("é", "e")])
def test_sanitized_names_never_collide(store, params):
    one, two = (store.path_for(f"t.py::test[{p}]") for p in params)
    assert one != two
    for path in (one, two):
        assert all(c.isascii() for c in path.name)


def test_names_that_need_no_sanitizing_are_kept_readable(store):
    assert store.path_for("t.py::test_x[bf16-batch_2-0.5]").name == "test_x.bf16-batch_2-0.5.safetensors"


@pytest.mark.parametrize("test_id", [
    "../../etc/passwd",
    "t.py::test[../../etc/passwd]",
    "t.py::..",
    "t.py::test[..]",
    "t.py::Cls/../../x::test",
    "sub/./test_x.py::test",
    "t.py::test[\u00e9\u00e8-\u6f22\u5b57-\U0001f600]",
    "t.py::test[" + "x" * 5000 + "]",
    "deep/" * 40 + "test_x.py::test",
])
def test_odd_ids_stay_under_the_root(store, test_id):
    path = store.path_for(test_id)
    assert path.resolve().is_relative_to(store.suite_dir.resolve())
    assert ".." not in path.relative_to(store.suite_dir).parts
    assert all(len(part) <= bl.MAX_COMPONENT + len(bl.SUFFIX) for part in path.relative_to(store.suite_dir).parts)
    assert store.write(test_id, make_checks(), PROV) == "created"
    assert store.load(test_id) is not None
    assert not any(p.name == "passwd" for p in store.root.parent.rglob("passwd"))


def test_long_ids_differing_at_the_end_get_different_files(store):
    base = "t.py::test[" + "x" * 500
    assert store.path_for(base + "1]") != store.path_for(base + "2]")


@pytest.mark.parametrize("test_id", ["../../etc/passwd::test", "/etc/passwd::test", "C:/x/test_x.py::t",
                                     "a.py::t[\0]", ""])
def test_ids_that_would_escape_are_rejected(store, test_id):
    with pytest.raises(BaselineError):
        store.path_for(test_id)


def test_symlink_out_of_the_store_is_rejected(store, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (store.suite_dir).mkdir(parents=True)
    (store.suite_dir / "evil").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(BaselineError, match="outside the baseline directory"):
        store.path_for("evil/test_x.py::t")
    assert list(elsewhere.iterdir()) == []


def test_bad_suite_name_rejected(tmp_path):
    for suite in ("", "..", "a/b"):
        with pytest.raises(ValueError):
            BaselineStore(tmp_path, suite)


# --------------------------------------------------------------------------------------------
# bad input to write


def test_write_rejects_bad_checks(store):
    with pytest.raises(ValueError, match="named 'other'"):
        store.write("t.py::t", {"c": CheckBaseline("other", {}, [], {})}, {})
    with pytest.raises(TypeError, match="meta of check 'c'"):
        store.write("t.py::t", {"c": CheckBaseline("c", {}, [], {"when": object()})}, {})
    with pytest.raises(TypeError, match="leaf 'x' is a list"):
        store.write("t.py::t", {"c": CheckBaseline("c", {"x": [1.0]}, [], {})}, {})
    assert not store.path_for("t.py::t").exists()


# --------------------------------------------------------------------------------------------
# budget


def test_loading_five_megabytes_is_fast(store):
    g = torch.Generator().manual_seed(0)
    checks = {f"c{i}": CheckBaseline(f"c{i}", {"out": torch.randn(100_000, generator=g),
                                               "h": torch.randn(200_000, generator=g).to(torch.bfloat16)}, [], {})
              for i in range(6)}
    store.write("t.py::big", checks, PROV)
    size = store.path_for("t.py::big").stat().st_size
    assert 4.5e6 < size < 5.5e6  # tensor bytes plus a small header
    timings = []
    for _ in range(3):
        start = time.perf_counter()
        baseline = store.load("t.py::big")
        timings.append(time.perf_counter() - start)
    assert_same_checks(baseline.checks, checks)
    # a forward pass of the Aurora model takes ~0.6 s here; loading must stay far below that
    assert min(timings) < 0.25, timings


def test_safetensors_header_length_starting_with_pickle_opcode_is_not_refused(tmp_path):
    """A 1408-byte header is stored as b"\\x80\\x05\\0..." — the same two bytes as a pickle protocol-5 PROTO."""
    from pytest_npu_parity.baselines import _kind

    head = (1408).to_bytes(8, "little") + b"{"
    assert head[:2] == b"\x80\x05"
    assert _kind(head) == "safetensors"
    assert _kind(b"\x80\x05\x95\x10\x00\x00\x00\x00\x00") == "pickle"


def _recorded_with_summaries(tmp_path):
    """``(x, store, baseline)``: one check recorded for input ``x`` with its hash and summary."""
    from pytest_npu_parity.provenance import fingerprint_tensors, summarize_tensors

    x = torch.linspace(-3, 3, 1000)
    store = BaselineStore(tmp_path, "suite")
    meta = {"input_hash": fingerprint_tensors(x), "config_hash": "c", "input_summary": summarize_tensors(x),
            "config_tensors": {}}
    store.write("t.py::test", {"chk": CheckBaseline("chk", {"out": x * 2}, [], meta)}, {"device_type": "cpu"})
    return x, store, store.load("t.py::test")


def test_last_bit_differences_are_fresh_but_real_changes_are_stale(tmp_path):
    """Seeded weights or activations recomputed on another CPU differ in last bits: not stale.
    Another input (a different window) is stale, and the message says which summary moved."""
    from pytest_npu_parity.baselines import StaleBaselineError
    from pytest_npu_parity.provenance import fingerprint_tensors, summarize_tensors

    x, store, baseline = _recorded_with_summaries(tmp_path)
    ulp = torch.nextafter(x, torch.full_like(x, float("inf")))  # every element moved by one ULP
    entry = store.check_fresh(baseline, "chk", input_hash=fingerprint_tensors(ulp), config_hash="c",
                              input_summary=summarize_tensors(ulp), config_tensors={})
    assert entry.meta["bitwise_input"] is False and entry.meta["bitwise_config"] is True

    other = x + 0.01  # a different input
    with pytest.raises(StaleBaselineError, match=r"input hash changed \(recorded .*\): sum of .* differs"):
        store.check_fresh(baseline, "chk", input_hash=fingerprint_tensors(other), config_hash="c",
                          input_summary=summarize_tensors(other), config_tensors={})


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps (Linux)")
def test_loaded_tensors_are_memory_mapped_views_of_the_file(store):
    store.write(TEST_ID, make_checks(), PROV)
    path = store.path_for(TEST_ID).resolve()
    baseline = store.load(TEST_ID)
    spans = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].strip() == str(path):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            spans.append((lo, hi))
    assert spans, f"{path} is not mapped"
    tensors = [t for check in baseline.checks.values() for t in check.tensors.values() if t.numel()]
    assert tensors and all(any(lo <= t.data_ptr() < hi for lo, hi in spans) for t in tensors)


def test_replacing_a_loaded_file_leaves_the_loaded_tensors_intact(store):
    store.write(TEST_ID, make_checks(seed=0), PROV)
    before = {leaf: t.clone() for leaf, t in store.load(TEST_ID).checks["dec_layer_0"].tensors.items()}
    loaded = store.load(TEST_ID)
    store.write(TEST_ID, make_checks(seed=1), PROV)  # atomic replace while the old file is mapped
    for leaf, tensor in loaded.checks["dec_layer_0"].tensors.items():
        assert torch.equal(tensor, before[leaf])
    assert not torch.equal(store.load(TEST_ID).checks["dec_layer_0"].tensors["[0]"], before["[0]"])


def test_summaries_are_computed_only_when_a_hash_differs(tmp_path):
    from pytest_npu_parity.provenance import fingerprint_tensors, summarize_tensors

    x, store, baseline = _recorded_with_summaries(tmp_path)
    calls = []

    def summary_of(t):
        return lambda: calls.append(1) or summarize_tensors(t)

    store.check_fresh(baseline, "chk", input_hash=fingerprint_tensors(x), config_hash="c",
                      input_summary=summary_of(x), config_tensors=summary_of(x))
    assert calls == []  # both hashes match: no pass over the data
    ulp = torch.nextafter(x, torch.full_like(x, float("inf")))
    entry = store.check_fresh(baseline, "chk", input_hash=fingerprint_tensors(ulp), config_hash="c",
                              input_summary=summary_of(ulp), config_tensors=summary_of(x))
    assert calls == [1] and entry.meta["bitwise_input"] is False
