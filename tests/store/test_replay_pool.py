"""baselines.ObjectPool: the inputs, weights and goldens that several baseline files record, stored once per store.

A two-test project on one small MLP (its first layer's weight, 8 KiB, and its input, 8 KiB, are over
``POOL_MIN_BYTES``; its second layer's weight, 2 KiB, is not) is recorded for fp32 and bf16: the four files
must reference one pool object per distinct tensor. A pool object deleted or corrupted must fail the check
with a message naming the baseline file, the check, the object and the re-record command; concurrent writers
of one object must leave one valid object; pruning must remove orphans only; and on another CPU kernel path
the pooled weights must replay, while a planted fault still fails and a weight edit is still stale.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from locations import TESTS
from pytester_helpers import edit_module
from test_own_models import FAULT_CONFTEST

from pytest_npu_parity import baselines as bl
from pytest_npu_parity.store import encoding as store_encoding
from pytest_npu_parity.baselines import (OBJECTS_DIR, BaselineStore, CheckBaseline, CorruptBaselineError, ObjectPool,
                                         SuiteStores, object_digest)

MLP = '''
import torch
from torch import nn


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8)).eval(), torch.randn(64, 32)


def test_eval(parity):
    model, x = build()
    parity.check("eval", model, x)


def test_eval_again(parity):
    model, x = build()
    parity.check("again", model, x)
'''
FILES = {"test_eval": "test_mlp.py::test_eval", "test_eval_again": "test_mlp.py::test_eval_again"}


def _build() -> tuple[torch.nn.Module, torch.Tensor]:
    namespace: dict = {}
    exec(MLP, namespace)
    return namespace["build"]()


def _project(pytester: pytest.Pytester, recipes: str = "fp32,bf16") -> pytest.RunResult:
    pytester.makeini(f"""
        [pytest]
        parity_dtypes = {recipes}
    """)
    pytester.makeconftest(FAULT_CONFTEST)
    (pytester.path / "test_mlp.py").write_text(MLP, encoding="utf-8")
    result = pytester.runpytest("--update-baselines", "-p", "no:randomly")
    assert result.ret == 0, result.stdout.str()
    return result


def _compare(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest("--npu-parity", "--parity-reference", "baseline", "-p", "no:randomly",
                              "--parity-localize-budget=0", *args)


def _objects(root: Path) -> list[Path]:
    return sorted((root / OBJECTS_DIR).rglob("*.safetensors"))


def test_the_fp32_and_bf16_files_and_two_tests_on_one_model_share_one_copy(pytester: pytest.Pytester) -> None:
    _project(pytester)
    root = pytester.path / "baselines"
    stores = SuiteStores(root)
    files = stores.baseline_files()
    assert len(files) == 4 and not any(OBJECTS_DIR in p.parts for p in files)
    model, x = _build()
    refs = stores.referenced_objects()
    shared = {"weight 0.weight": object_digest(model[0].weight.detach()), "input": object_digest(x)}
    for what, digest in shared.items():
        assert sorted(refs[digest]) == files, what  # all four files, both recipes, both tests: one object
        assert stores.pool.path_for(digest).is_file(), what
    assert len(_objects(root)) == len(refs)  # one file per distinct digest, nothing else
    # a tensor under POOL_MIN_BYTES stays in each file
    assert object_digest(model[2].weight.detach()) not in refs
    for path in files:
        header = json.loads(path.read_bytes()[8:8 + int.from_bytes(path.read_bytes()[:8], "little")])
        assert header["__metadata__"]["format_version"] == str(bl.FORMAT_VERSION)
        assert not any(info.get("shape") == [64, 32] for key, info in header.items() if key != "__metadata__")
    # bytes: the store is smaller than the same recording with every extra in its file
    pooled = sum(p.stat().st_size for p in root.rglob("*.safetensors"))
    flat = pytester.mkdir("flat")
    with pytest.MonkeyPatch.context() as patch:  # not pytester's monkeypatch: undoing that leaves its directory
        patch.setattr(store_encoding, "POOL_MIN_BYTES", 1 << 40)  # read where an extra is stored
        result = pytester.runpytest("--update-baselines", "-p", "no:randomly", f"--baseline-dir={flat}")
    assert result.ret == 0 and not (flat / OBJECTS_DIR).exists()
    inline = sum(p.stat().st_size for p in flat.rglob("*.safetensors"))
    assert pooled + 3 * (8192 + 8192) <= inline + 4 * 1024, (pooled, inline)  # 3 of 4 copies of each saved
    # and the pooled recording compares green here, re-recording it changes nothing
    _compare(pytester).assert_outcomes(passed=4)
    again = pytester.runpytest("--update-baselines", "-p", "no:randomly")
    assert again.ret == 0 and "changed" not in again.stdout.str().split("npu-parity")[-1].replace("unchanged", "")


@pytest.mark.parametrize("damage", ["delete", "flip"])
def test_a_missing_or_corrupt_pool_object_fails_naming_the_file_the_check_and_the_fix(
        pytester: pytest.Pytester, damage: str) -> None:
    _project(pytester, "fp32")
    root = pytester.path / "baselines"
    model, _ = _build()
    obj = SuiteStores(root).pool.path_for(object_digest(model[0].weight.detach()))
    if damage == "delete":
        obj.unlink()
    else:
        data = bytearray(obj.read_bytes())
        data[-5] ^= 0x04  # a bit of the tensor's data
        obj.write_bytes(bytes(data))
    result = _compare(pytester)
    result.assert_outcomes(failed=2)
    out = result.stdout.str()
    reason = "is missing (deleted, pruned, or not committed beside the baseline files" if damage == "delete" else \
        "is corrupt: its tensor hashes to"
    for check, test in (("eval", "test_eval"), ("again", "test_eval_again")):
        assert (f"baselines/_rootdir/test_mlp/{test}.fp32.safetensors: check '{check}' needs its recorded weight "
                f"'weight:0.weight' from the object pool, but baselines/.objects/") in out, out
    assert reason in out and obj.name in out
    assert "Re-record it with: pytest --update-baselines 'test_mlp.py::test_eval[fp32]'" in out
    assert "Traceback" not in out and "passed" not in out.splitlines()[-1]
    # the fix the message gives repairs it
    assert pytester.runpytest("--update-baselines", "-p", "no:randomly").ret == 0
    assert ObjectPool(root).get(object_digest(model[0].weight.detach())) is not None
    _compare(pytester).assert_outcomes(passed=2)


WRITER = r"""
import sys, time, torch
from pytest_npu_parity.baselines import ObjectPool
pool, start = ObjectPool(sys.argv[1]), float(sys.argv[2])
while time.time() < start:
    time.sleep(0.001)
base = torch.arange(4096, dtype=torch.float32)
for i in range(40):
    pool.put(base + i)
"""


def test_concurrent_writers_of_one_object_leave_one_valid_object(tmp_path: Path) -> None:
    import time

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(bl.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    start = time.time() + 4.0  # both interpreters import torch first, then write the same 40 objects at once
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(start)], env=env) for _ in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    pool = ObjectPool(tmp_path)
    found = pool.objects()
    base = torch.arange(4096, dtype=torch.float32)
    assert [d for d, _ in found] == sorted(object_digest(base + i) for i in range(40))
    for digest, _ in found:
        assert torch.equal(pool.get(digest), base + [i for i in range(40) if object_digest(base + i) == digest][0])
    leftovers = [p for p in (tmp_path / OBJECTS_DIR).rglob("*") if p.is_file() and not bl._OBJECT_NAME.match(p.name)]
    assert leftovers == []


def _write(stores: SuiteStores, test_id: str, weight: torch.Tensor) -> None:
    stores.write(test_id, {"c": CheckBaseline("c", {"": torch.zeros(2)}, extras={"weight:w": weight})}, {"device": "cpu"})


def test_prune_removes_only_what_no_file_references(tmp_path: Path) -> None:
    stores = SuiteStores(tmp_path)
    a, b, c = (torch.full((1024,), float(i)) for i in range(3))
    _write(stores, "t.py::t_a", a)
    _write(stores, "u.py::t_b", b)
    assert stores.orphan_objects() == []
    _write(stores, "t.py::t_a", c)  # re-recorded: a's object is an orphan now, b's file was not touched
    orphans = stores.orphan_objects()
    assert [p for p, _ in orphans] == [stores.pool.path_for(object_digest(a))]
    # a file whose header cannot be read might reference anything: nothing is deleted
    broken = stores.path_for("v.py::t_c")
    broken.parent.mkdir(parents=True)
    broken.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(CorruptBaselineError, match="v/t_c.safetensors has an unreadable header"):
        stores.prune_objects()
    assert stores.pool.path_for(object_digest(a)).exists()
    broken.unlink()
    removed = stores.prune_objects()
    assert [p for p, _ in removed] == [stores.pool.path_for(object_digest(a))]
    assert not stores.pool.path_for(object_digest(a)).exists()
    for test_id, tensor in (("t.py::t_a", c), ("u.py::t_b", b)):
        assert torch.equal(stores.load(test_id).checks["c"].extras["weight:w"], tensor)
    assert stores.prune_objects() == []


def test_the_cli_prunes_under_the_lock_and_verifies(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    stores = SuiteStores(tmp_path)
    a, b = torch.full((1024,), 1.0), torch.full((1024,), 2.0)
    _write(stores, "t.py::t_a", a)
    _write(stores, "t.py::t_a", b)
    assert bl.main(["prune", "--baseline-dir", str(tmp_path), "--dry-run"]) == 0
    assert "would delete 1 unreferenced pool objects" in capsys.readouterr().out
    assert stores.pool.path_for(object_digest(a)).exists()
    with stores.lock():  # a record run holds the store: prune waits, then gives up naming the lock
        assert bl.main(["prune", "--baseline-dir", str(tmp_path), "--lock-timeout", "0.2"]) == 1
    assert "still being updated by another process" in capsys.readouterr().err
    assert bl.main(["prune", "--baseline-dir", str(tmp_path)]) == 0
    assert "deleted 1 unreferenced pool objects (4," in capsys.readouterr().out
    assert bl.main(["verify", "--baseline-dir", str(tmp_path)]) == 0
    stores.pool.path_for(object_digest(b)).unlink()
    assert bl.main(["verify", "--baseline-dir", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "check 'c' needs its recorded weight 'weight:w' from the object pool" in captured.err
    assert "1 baseline files, 0 read and verified, 1 failed" in captured.out
    assert bl.main(["verify", "--baseline-dir", str(tmp_path / "nowhere")]) == 2


def test_a_record_run_prunes_the_objects_it_orphaned_and_keeps_the_others(pytester: pytest.Pytester) -> None:
    _project(pytester, "fp32")
    root = pytester.path / "baselines"
    model, x = _build()
    old_input = object_digest(x)
    edit_module(pytester.path / "test_mlp.py", '''def test_eval(parity):
    model, x = build()''', '''def test_eval(parity):
    model, x = build()
    x = x * 2''')
    result = pytester.runpytest("--update-baselines", "-p", "no:randomly", "-k", "test_eval and not again")
    assert result.ret == 0, result.stdout.str()
    assert "pruned" not in result.stdout.str()  # test_eval_again still references the old input
    assert SuiteStores(root).pool.path_for(old_input).exists()
    edit_module(pytester.path / "test_mlp.py", '''def test_eval_again(parity):
    model, x = build()''', '''def test_eval_again(parity):
    model, x = build()
    x = x * 2''')
    result = pytester.runpytest("--update-baselines", "-p", "no:randomly", "-k", "again")
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(["baselines: pruned 1 pool objects no baseline file references (8,*"])
    assert not SuiteStores(root).pool.path_for(old_input).exists()
    _compare(pytester).assert_outcomes(passed=2)


def test_version_3_files_still_read(tmp_path: Path) -> None:
    committed = TESTS / "data" / "replay_baselines"
    shutil.copytree(committed, tmp_path / "baselines")
    stores = SuiteStores(tmp_path / "baselines")
    baseline = stores.load("test_gpt2.py::test_gpt2[fp32]")
    header = baseline.path.read_bytes()
    assert json.loads(header[8:8 + int.from_bytes(header[:8], "little")])["__metadata__"]["format_version"] == "3"
    weights = [w for check in baseline.checks.values() for w in check.extras if w.startswith("weight:")]
    assert weights and not (tmp_path / "baselines" / OBJECTS_DIR).exists()
    # a version-3 file cannot reference the pool: an object key there is corruption, not a lookup
    store = BaselineStore(tmp_path / "b", "s")
    store.write("t.py::t", {"c": CheckBaseline("c", {"": torch.zeros(2)}, extras={"weight:w": torch.ones(1024)})}, {})
    path = store.path_for("t.py::t")
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    header["__metadata__"]["format_version"] = "3"
    from safetensors.torch import save

    with open(path, "wb") as fh:  # keep the (now stale) checksum: the lookup must be refused before it
        fh.write(save({"c": torch.zeros(2)}, metadata=header["__metadata__"]))
    with pytest.raises(CorruptBaselineError, match="lacks the recorded inputs/weights of check 'c'"):
        store.load("t.py::t")


OTHER_PATH = {"ATEN_CPU_CAPABILITY": "default"}


def test_on_another_kernel_path_pooled_weights_replay_a_fault_fails_and_an_edit_is_stale(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    _project(pytester, "fp32")
    for key, value in OTHER_PATH.items():
        monkeypatch.setenv(key, value)
    args = ("--npu-parity", "--parity-reference", "baseline", "-p", "no:randomly", "--parity-localize-budget=0", "-rN")
    result = pytester.runpytest_subprocess(*args)
    result.assert_outcomes(passed=2)
    out = result.stdout.str()
    assert "is stale" not in out and out.count("replayed the recorded inputs (") == 2, out
    assert out.count(") and the recorded weights (largest draw difference") == 2, out  # read from the pool
    monkeypatch.setenv("OWN_MODEL_FAULT", "eval:1e-4")
    result = pytester.runpytest_subprocess(*args)
    result.assert_outcomes(passed=1, failed=1)
    assert "Parity check 'eval' failed" in result.stdout.str() and "is stale" not in result.stdout.str()
    monkeypatch.delenv("OWN_MODEL_FAULT")
    edit_module(pytester.path / "test_mlp.py", '    parity.check("eval", model, x)',
                '    with torch.no_grad():\n        model[0].weight.mul_(1 + 1e-4)\n    parity.check("eval", model, x)')
    result = pytester.runpytest_subprocess(*args, "-k", "test_eval and not again")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "is stale for check 'eval'" in out and "not replayed: weight 0.weight differs by up to 0.0001" in out, out
