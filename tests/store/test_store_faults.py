"""Reliability of the baseline store, the options and odd outputs under attack: interruption,
concurrency, tampering, colliding test ids and bad option values. Each attack is one test; the
ones that are a pytest run use pytester (in process) or, to kill a run for real, a subprocess on a
tiny project. Every attack here once lost a recording, gave a wrong verdict, crashed or gave a
weak message; each test states what must hold now."""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from pytester_helpers import edit_module
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pytest_npu_parity import baselines as baselines_module
from pytest_npu_parity.baselines import (BaselineStore, CheckBaseline, CorruptBaselineError, StaleBaselineError,
                                         StoreLock, StoreLockedError, SuiteStores)

# Imported once here: pytester forgets modules first imported during an in-process run.
import hypothesis  # noqa: E402,F401
import pytest_npu_parity.npu  # noqa: E402,F401
import pytest_npu_parity.runner  # noqa: E402,F401
import pandas  # noqa: E402,F401  (--parity-report writes parquet/csv through pandas and pyarrow)
import pyarrow  # noqa: E402,F401

TWO_TESTS = """
import pytest, torch

def shifted(x, shift=0.0):
    return torch.tanh(x) + shift

def test_a(parity):
    parity.check("a", shifted, torch.linspace(-2, 2, 10))

def test_b(parity):
    parity.check("b", shifted, torch.linspace(-3, 1, 10), shift=1.0)
"""
A_ID = "parity_suites/demo/test_model.py::test_a[fp32]"
B_ID = "parity_suites/demo/test_model.py::test_b[fp32]"
A_FILE = "baselines/demo/test_model/test_a.fp32.safetensors"
B_FILE = "baselines/demo/test_model/test_b.fp32.safetensors"


def _project(pytester: pytest.Pytester, module: str = TWO_TESTS, ini: str = "") -> Path:
    pytester.makeini("[pytest]\nparity_dtypes = fp32\n" + textwrap.dedent(ini))
    suite = pytester.path / "parity_suites" / "demo"
    suite.mkdir(parents=True, exist_ok=True)
    path = suite / "test_model.py"
    path.write_text(textwrap.dedent(module))
    return path




def _record(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    result = pytester.runpytest("--update-baselines", *args)
    assert result.ret == 0, result.stdout.str() + result.stderr.str()
    return result


def _usage_error(result: pytest.RunResult, *lines: str) -> None:
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str() + result.stderr.str()
    result.stderr.fnmatch_lines(list(lines))
    assert "Traceback" not in result.stderr.str() + result.stdout.str()


# --------------------------------------------------------------------------------------------
# lost recordings


HALF_RUN = """
import pytest, torch

STOP = None

def test_two(parity):
    parity.check("first", torch.tanh, torch.linspace(-2, 2, 10))
    if STOP == "skip":
        pytest.skip("stopped between the checks")
    if STOP == "ctrl-c":
        raise KeyboardInterrupt
    parity.check("second", torch.sin, torch.linspace(-2, 2, 10))
"""
TWO_FILE = "baselines/demo/test_model/test_two.fp32.safetensors"
TWO_ID = "parity_suites/demo/test_model.py::test_two[fp32]"


@pytest.mark.parametrize("stop", ["skip", "ctrl-c"])
def test_a_test_stopped_between_its_checks_keeps_its_complete_baseline(pytester: pytest.Pytester, stop: str) -> None:
    module = _project(pytester, HALF_RUN)
    _record(pytester, "parity_suites")
    before = (pytester.path / TWO_FILE).read_bytes()
    edit_module(module, "STOP = None", f"STOP = {stop!r}")
    result = pytester.runpytest("--update-baselines", "parity_suites", no_reraise_ctrlc=True)
    result.stdout.fnmatch_lines(["baselines: 1 not written (1 file under baselines)",
                                 f"  not written  {TWO_FILE}  <- {TWO_ID.replace('[', '[[]')} (the test *)"])
    assert (pytester.path / TWO_FILE).read_bytes() == before
    assert set(SuiteStores(pytester.path / "baselines").load(TWO_ID).checks) == {"first", "second"}
    # and the next compare run compares `second` with the baseline, not with a live CPU run
    edit_module(module, f"STOP = {stop!r}", "STOP = None")
    result = pytester.runpytest("--npu-parity", "parity_suites")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["reference: 2 checks vs baseline *"])


def test_a_class_and_a_module_of_the_same_name_get_distinct_files(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nparity_dtypes = fp32\npython_files = test_*.py Test_*.py\n")
    pytester.makepyfile(test_coll="""
        import torch
        class Test_sub_test:
            def test_a(self, parity):
                parity.check("c", torch.tanh, torch.linspace(-2, 2, 10))
    """)
    (pytester.path / "test_coll").mkdir()
    (pytester.path / "test_coll" / "Test_sub_test.py").write_text(
        "import torch\ndef test_a(parity):\n    parity.check('c', torch.sin, torch.linspace(-2, 2, 10))\n")
    result = _record(pytester, "test_coll.py", "test_coll")
    result.stdout.fnmatch_lines(["baselines: 2 created (2 files under baselines)"])
    assert sorted(str(p.relative_to(pytester.path)) for p in (pytester.path / "baselines").rglob("*.safetensors")) == [
        "baselines/_rootdir/test_coll/Test_sub_test+test_a.fp32.safetensors",
        "baselines/_rootdir/test_coll/Test_sub_test/test_a.fp32.safetensors"]
    result = pytester.runpytest("--npu-parity", "--parity-reference=baseline", "test_coll.py", "test_coll")
    result.assert_outcomes(passed=2)


def test_ids_inside_and_outside_parity_suites_get_distinct_files(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nparity_dtypes = fp32\naddopts = --import-mode=importlib\n")
    for folder, fn in (("mini", "tanh"), ("parity_suites/mini", "sin")):
        (pytester.path / folder).mkdir(parents=True)
        (pytester.path / folder / "test_top.py").write_text(
            f"import torch\ndef test_a(parity):\n    parity.check('c', torch.{fn}, torch.linspace(-2, 2, 10))\n")
    result = _record(pytester, "mini", "parity_suites")
    result.stdout.fnmatch_lines(["baselines: 2 created (2 files under baselines)"])
    assert (pytester.path / "baselines/_rootdir/mini/test_top/test_a.fp32.safetensors").is_file()
    assert (pytester.path / "baselines/mini/test_top/test_a.fp32.safetensors").is_file()
    result = pytester.runpytest("--npu-parity", "--parity-reference=baseline", "mini", "parity_suites")
    result.assert_outcomes(passed=2)


def test_a_temporary_file_of_a_killed_write_is_reported_then_removed(pytester: pytest.Pytester) -> None:
    _project(pytester)
    _record(pytester, "parity_suites")
    leftover = pytester.path / "baselines/demo/test_model/.test_a.fp32.safetensors.x7Kq_2.tmp"
    leftover.write_bytes(b"\0" * 1000)
    result = pytester.runpytest("--npu-parity", "parity_suites")
    result.stdout.fnmatch_lines(["baselines: 1 temporary file (1000 bytes) left by an interrupted record run; *"])
    assert leftover.exists()
    result = _record(pytester, "parity_suites")
    result.stdout.fnmatch_lines(["baselines: removed 1 temporary file (1000 bytes) left by an interrupted record run:",
                                 "  baselines/demo/test_model/.test_a.fp32.safetensors.x7Kq_2.tmp (1000 bytes)"])
    assert not leftover.exists()


# Record runs killed for real: a subprocess on a tiny project whose tests write 2 MB per check and
# pause between their two checks, killed after a random delay (seeded; the seed is in the message).
KILL_MODULE = """
import os, time, torch

VERSION = float(os.environ.get("DEMO_VERSION", "0"))
HOLD = os.environ.get("DEMO_HOLD")  # the first test waits until this file exists (at most 60 s)

def out(x, k):
    return x * k + VERSION

def _one(parity, i):
    if HOLD:  # this run holds the store's lock from its start: say it has got that far
        open(HOLD + ".reached", "w").close()
    deadline = time.monotonic() + 60
    while HOLD and not os.path.exists(HOLD) and time.monotonic() < deadline:
        time.sleep(0.02)
    x = torch.linspace(-1, 1, 1 << 19)
    parity.check("first", out, x, i + 1.0)
    time.sleep(0.05)
    parity.check("second", out, x, i + 1.5)

def test_0(parity): _one(parity, 0)
def test_1(parity): _one(parity, 1)
def test_2(parity): _one(parity, 2)
def test_3(parity): _one(parity, 3)
"""
KILL_IDS = [f"parity_suites/demo/test_model.py::test_{i}[fp32]" for i in range(4)]


def _kill_project(tmp_path: Path) -> Path:
    (tmp_path / "pytest.ini").write_text("[pytest]\nparity_dtypes = fp32\n")
    suite = tmp_path / "parity_suites" / "demo"
    suite.mkdir(parents=True)
    (suite / "test_model.py").write_text(textwrap.dedent(KILL_MODULE))
    return tmp_path


def _start(project: Path, version: float, *args: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pytest", "--update-baselines", "-p", "no:cacheprovider", "parity_suites", *args],
        cwd=project, env={**os.environ, "DEMO_VERSION": str(version), **env},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _versions(project: Path) -> dict[str, float]:
    """The version every baseline file holds; fails unless each file is complete and consistent."""
    stores = SuiteStores(project / "baselines")
    x = torch.linspace(-1, 1, 1 << 19)
    found = {}
    for i, test_id in enumerate(KILL_IDS):
        baseline = stores.load(test_id)  # raises on a corrupt, partial or foreign file
        assert baseline is not None and set(baseline.checks) == {"first", "second"}, test_id
        version = float(round(float(baseline.checks["first"].tensors[""][0] - x[0] * (i + 1.0))))
        for name, k in (("first", i + 1.0), ("second", i + 1.5)):
            assert torch.equal(baseline.checks[name].tensors[""], x * k + version), (test_id, name)
        found[test_id] = version
    return found


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
def test_record_runs_killed_at_random_points_leave_old_or_complete_new_files(tmp_path: Path, sig) -> None:
    project = _kill_project(tmp_path)
    start = time.monotonic()
    first = _start(project, 0)
    out, _ = first.communicate(timeout=120)
    span = time.monotonic() - start  # how long one record run takes here, start-up included
    assert first.returncode == 0, out
    seed = int(os.environ.get("NPU_PARITY_FAULT_SEED", random.randrange(10**6)))
    rng = random.Random(seed)
    for attempt in range(2):
        version = attempt + 1.0
        delay = rng.uniform(0.3 * span, span)
        run = _start(project, version)
        time.sleep(delay)
        run.send_signal(sig)
        out, _ = run.communicate(timeout=120)
        context = f"seed {seed} (NPU_PARITY_FAULT_SEED), attempt {attempt}, {sig.name} after {delay:.2f}s:\n{out}"
        versions = _versions(project)
        assert set(versions.values()) <= {version - 1.0, version}, context  # each file old or new, whole
        if sig == signal.SIGINT:  # Python-level cleanup ran: no temporary file is left
            assert not SuiteStores(project / "baselines").temporary_files(), context
        # the next full run records every test completely and removes what the killed one left
        leftovers = SuiteStores(project / "baselines").temporary_files()
        run = _start(project, version)
        out, _ = run.communicate(timeout=120)
        assert run.returncode == 0, context + out
        assert set(_versions(project).values()) == {version}, context
        if leftovers:
            assert f"baselines: removed {len(leftovers)} temporary file" in out, context + out
        assert not SuiteStores(project / "baselines").temporary_files(), context


def test_two_record_runs_on_one_store_run_one_after_the_other(tmp_path: Path) -> None:
    import threading

    project = _kill_project(tmp_path)
    hold = tmp_path / "go-on"
    first = _start(project, 1.0, DEMO_HOLD=str(hold))  # holds the lock, waits in its first test
    reached = Path(str(hold) + ".reached")
    deadline = time.monotonic() + 120  # a loaded machine may take many seconds to import torch
    while not reached.exists():
        assert time.monotonic() < deadline and first.poll() is None, "the first record run did not start"
        time.sleep(0.05)
    second = _start(project, 2.0)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(second.stdout.readline, "")), daemon=True)
    reader.start()
    deadline = time.monotonic() + 60
    while not any("is being updated by another process" in line for line in lines):
        assert time.monotonic() < deadline and second.poll() is None, "".join(lines)
        time.sleep(0.05)
    hold.touch()  # the second run waits for the lock: let the first one finish
    out_first, _ = first.communicate(timeout=120)
    second.wait(timeout=120)
    reader.join(timeout=10)
    out_second = "".join(lines)
    assert first.returncode == 0 and second.returncode == 0, out_first + out_second
    assert "is being updated by another process" in out_second and "waiting" in out_second, out_second
    assert set(_versions(project).values()) == {2.0}  # the second run ran after the first, whole
    assert "baselines: 4 created" in out_first and "baselines: 4 changed" in out_second


def test_a_held_store_lock_times_out_with_a_message_naming_it(tmp_path: Path) -> None:
    holder = StoreLock(tmp_path / "store")
    holder.acquire()
    try:
        messages = []
        with pytest.raises(StoreLockedError, match=r"still being updated by another process after 0\.2 s .*\.npu-parity\.lock"):
            StoreLock(tmp_path / "store").acquire(timeout=0.2, on_wait=messages.append)
        assert messages and "waiting up to 0.2 s" in messages[0]
    finally:
        holder.release()
    StoreLock(tmp_path / "store").acquire(timeout=0)  # free again


# --------------------------------------------------------------------------------------------
# wrong verdicts


def test_a_symlink_to_another_tests_baseline_is_refused(pytester: pytest.Pytester) -> None:
    _project(pytester)
    _record(pytester, "parity_suites")
    link = pytester.path / B_FILE
    link.unlink()
    link.symlink_to("test_a.fp32.safetensors")
    result = pytester.runpytest("--npu-parity", "parity_suites")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*refusing baselines/demo/test_model/test_b.fp32.safetensors: it is a symbolic link "
                                 "to test_a.fp32.safetensors*", "  unsafe  *test_b*"])
    result = _record(pytester, "parity_suites")  # recording replaces the link by a regular file
    assert not link.is_symlink() and pytester.runpytest("--npu-parity", "parity_suites").ret == 0


def test_a_copy_of_another_tests_baseline_is_stale_naming_both_ids(pytester: pytest.Pytester) -> None:
    _project(pytester)
    _record(pytester, "parity_suites")
    shutil.copyfile(pytester.path / A_FILE, pytester.path / B_FILE)
    result = pytester.runpytest("--npu-parity", "parity_suites")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([f"*was recorded for test '{A_ID}', not for '{B_ID}'*".replace("[", "[[]"),
                                 "  stale  *test_b*"])


def test_a_baseline_recorded_under_another_seed_is_stale(pytester: pytest.Pytester) -> None:
    _project(pytester, """
        import torch
        def test_drop(parity):
            layer = torch.nn.Dropout(0.5).train()
            parity.check("drop", layer, torch.linspace(1, 2, 64))
    """)
    _record(pytester, "parity_suites")
    assert pytester.runpytest("--npu-parity", "parity_suites").ret == 0
    result = pytester.runpytest("--npu-parity", "--parity-seed=5", "parity_suites")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*stale for check 'drop': recorded with seed 0, this run uses seed 5*"])
    assert "Mismatched elements" not in result.stdout.str()  # not judged as a target fault


def test_a_recording_of_another_recipe_is_stale(tmp_path: Path) -> None:
    store = BaselineStore(tmp_path, "suite")
    meta = {"input_hash": "i", "config_hash": "c", "recipe": "bf16", "seed": 0}
    store.write("t.py::t[fp32]", {"c": CheckBaseline("c", {"": torch.ones(2, dtype=torch.bfloat16)}, [], meta)}, {})
    with pytest.raises(StaleBaselineError, match=r"recorded under recipe 'bf16', this run uses 'fp32'"):
        store.check_fresh(store.load("t.py::t[fp32]"), "c", input_hash="i", config_hash="c", recipe="fp32", seed=0,
                          dtypes={"": torch.float32})


ROWS_MODULE = """
import pytest, torch

FLIP_INPUT = False
PERMUTE_WEIGHT = False

@pytest.fixture
def layer():
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 4).eval()
    if PERMUTE_WEIGHT:
        with torch.no_grad():
            layer.weight.copy_(layer.weight[[1, 0, 2, 3]])
    return layer

def test_rows(parity, layer):
    x = torch.linspace(-1, 1, 24).reshape(3, 8)
    if FLIP_INPUT:
        x = x.flip(0)
    parity.check("rows", layer, x)
"""


@pytest.mark.parametrize("what, message", [
    ("FLIP_INPUT", "input hash changed (recorded *): position-weighted sum (the order of its values) of .* differs*"),
    ("PERMUTE_WEIGHT", "weights changed (1 of 2 tensors differ, e.g. 'weight'); model fingerprint recorded *"),
])
def test_the_same_values_in_another_order_are_stale(pytester: pytest.Pytester, what: str, message: str) -> None:
    module = _project(pytester, ROWS_MODULE)
    _record(pytester, "parity_suites")
    edit_module(module, f"{what} = False", f"{what} = True")
    result = pytester.runpytest("--npu-parity", "parity_suites")
    result.assert_outcomes(failed=1)
    result.stdout.re_match_lines([r".*stale for check 'rows': " + message.replace("(", r"\(").replace(")", r"\)")
                                 .replace("*", ".*").replace("[", r"\[")])
    assert "difference starts in" not in result.stdout.str()


NONE_MODULE = """
import pytest, torch

def nothing(x):
    return None

def test_none(parity):
    parity.check("none", nothing, torch.ones(3))

@pytest.mark.parity(vacuous_ok="prints only")
def test_none_allowed(parity):
    parity.check("none", nothing, torch.ones(3))
"""


def test_a_check_whose_output_holds_no_tensor_is_vacuous(pytester: pytest.Pytester) -> None:
    _project(pytester, NONE_MODULE)
    result = pytester.runpytest("--npu-parity", "parity_suites")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*Parity check 'none' is vacuous: its output holds no tensor: it is None*"])


def test_a_check_whose_output_holds_no_tensor_has_no_teeth_under_selfcheck(pytester: pytest.Pytester) -> None:
    _project(pytester, NONE_MODULE)
    result = pytester.runpytest("--npu-parity", "--parity-selfcheck", "parity_suites")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "teeth: 0/2 (0 %) of the checks fail when their output or a weight is perturbed beyond tolerance",
        "  no teeth: *test_none[[]fp32] check 'none' (fp32): its output holds no tensor to perturb",
        "  no teeth: *test_none_allowed[[]fp32] check 'none' (fp32): its output holds no tensor to perturb "
        "[[]vacuous_ok: prints only]",
    ])


# --------------------------------------------------------------------------------------------
# tampering and old files


def _rewrite_metadata(path: Path, **changes: str) -> None:
    """Rewrite a baseline with edited metadata fields and the same tensors and content_hash."""
    with safe_open(str(path), framework="pt") as handle:
        metadata = dict(handle.metadata())
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    metadata.update(changes)
    save_file(tensors, str(path), metadata=metadata)


@pytest.mark.parametrize("field", ["provenance", "test_id", "checks"])
def test_edited_metadata_fails_the_checksum_naming_the_file(pytester: pytest.Pytester, field: str) -> None:
    _project(pytester)
    _record(pytester, "parity_suites")
    path = pytester.path / A_FILE
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
    if field == "provenance":
        forged = dict(json.loads(metadata["provenance"]), torch="9.9.9", device_name="Ascend910B",
                      created="2020-01-01T00:00:00+00:00")
        _rewrite_metadata(path, provenance=json.dumps(forged, sort_keys=True))
    elif field == "test_id":
        _rewrite_metadata(path, test_id=A_ID.replace("test_a", "test_x"))
    else:
        checks = json.loads(metadata["checks"])
        checks["a"]["meta"]["seed"] = 5
        _rewrite_metadata(path, checks=json.dumps(checks, sort_keys=True))
    result = pytester.runpytest("--npu-parity", "parity_suites")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([f"*baseline {A_FILE} fails its checksum: its tensors or metadata*", "  corrupt  *test_a*"])
    assert "9.9.9" not in result.stdout.str() and "Ascend910B" not in result.stdout.str()


def test_a_file_of_the_previous_format_is_stale_with_the_record_command(tmp_path: Path) -> None:
    store = BaselineStore(tmp_path, "suite")
    path = store.path_for("t.py::t")
    path.parent.mkdir(parents=True)
    checks = {"c": {"leaves": {"": "c"}, "none_leaves": [], "meta": {}}}
    save_file({"c": torch.ones(2)}, str(path), metadata={
        "format": baselines_module.FORMAT, "format_version": "1", "test_id": "t.py::t", "provenance": "{}",
        "checks": json.dumps(checks), "content_hash": "x"})
    with pytest.raises(StaleBaselineError, match=r"format version 1; .* Re-record it with: pytest --update-baselines t\.py::t"):
        store.load("t.py::t")


# --------------------------------------------------------------------------------------------
# options and markers, validated at start-up


def test_a_seed_out_of_range_is_a_usage_error(pytester: pytest.Pytester) -> None:
    _project(pytester)
    _usage_error(pytester.runpytest("--npu-parity", f"--parity-seed={10**23}", "parity_suites"),
                 f"ERROR: --parity-seed={10**23} is out of range; use an integer from 0 to 2**63-1 (*)")


@pytest.mark.parametrize("option, value", [("--parity-report", "afile/report"), ("--parity-history", "afile/h.csv")])
def test_an_output_path_that_cannot_be_created_is_a_usage_error(pytester: pytest.Pytester, option, value) -> None:
    _project(pytester)
    (pytester.path / "afile").write_text("a file, not a folder")
    _usage_error(pytester.runpytest("--npu-parity", f"{option}={value}", "parity_suites"),
                 f"ERROR: {option}={value}: cannot be created: */afile is a file; pick another path")


@pytest.mark.parametrize("mode", ["--npu-parity", "--update-baselines"])
def test_a_regular_file_as_baseline_dir_is_a_usage_error(pytester: pytest.Pytester, mode: str) -> None:
    _project(pytester)
    (pytester.path / "store").write_text("not a folder")
    _usage_error(pytester.runpytest(mode, "--baseline-dir=store", "parity_suites"),
                 "ERROR: --baseline-dir=*store is a file, not a directory; *")


def test_a_read_only_store_is_one_usage_error_before_any_test(pytester: pytest.Pytester) -> None:
    _project(pytester)
    _record(pytester, "parity_suites")
    # Permissions as a non-root user sees them (root may write anywhere): the store is not writable.
    pytester.makeconftest("""
        import os
        _real = os.access

        def _access(path, mode, *args, **kwargs):
            if "baselines" in str(path) and mode & os.W_OK:
                return False
            return _real(path, mode, *args, **kwargs)

        os.access = _access

        def pytest_unconfigure(config):
            os.access = _real
    """)
    real = os.access
    try:
        result = pytester.runpytest("--update-baselines", "parity_suites")
    finally:
        os.access = real
    _usage_error(result, "ERROR: --update-baselines cannot write to the baseline store */baselines "
                         "(ini parity_baseline_dir): not writable: */baselines*; fix its permissions or record "
                         "into another --baseline-dir=DIR")
    assert "PermissionError" not in result.stdout.str()


def test_a_separate_path_value_that_moves_the_rootdir_is_a_usage_error(
        pytester: pytest.Pytester, tmp_path_factory: pytest.TempPathFactory) -> None:
    _project(pytester)
    outside = tmp_path_factory.mktemp("outside-store")
    # With no other path, pytest would take the store for the test path: rootdir above both, no ini file.
    _usage_error(pytester.runpytest("--npu-parity", "--baseline-dir", str(outside)),
                 f"ERROR: --baseline-dir {outside}: pytest took the separate value for a test path while choosing "
                 f"its rootdir and ini file (rootdir * instead of {pytester.path}, *); write --baseline-dir={outside} "
                 "with '='")
    result = pytester.runpytest("--npu-parity", f"--baseline-dir={outside}")
    result.assert_outcomes(passed=2)
    # a separate value that changes nothing is fine
    pytester.runpytest("--update-baselines", "--baseline-dir", "baselines", "parity_suites").assert_outcomes(passed=2)


def test_a_separate_path_value_in_pytest_addopts_that_moves_the_rootdir_is_a_usage_error(
        pytester: pytest.Pytester, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    _project(pytester)
    outside = tmp_path_factory.mktemp("outside-report")
    # PYTEST_ADDOPTS is parsed before the rootdir is chosen, like the command line: the same trap.
    monkeypatch.setenv("PYTEST_ADDOPTS", f"--parity-report {outside}")
    _usage_error(pytester.runpytest("--npu-parity"),
                 f"ERROR: --parity-report {outside} (in PYTEST_ADDOPTS): pytest took the separate value for a test "
                 f"path while choosing its rootdir and ini file (rootdir * instead of {pytester.path}, *); write "
                 f"--parity-report={outside} with '='")
    monkeypatch.setenv("PYTEST_ADDOPTS", f"--parity-report={outside}")
    pytester.runpytest("--npu-parity").assert_outcomes(passed=2)
    assert (outside / "summary.md").is_file()


def _hint(result: pytest.RunResult, after: str) -> list[str]:
    """The command a failure message suggests (the words after ``after`` on the first line with it)."""
    import shlex

    line = next(x for x in result.stdout.lines if after in x)
    return shlex.split(line.partition(after)[2].split("`")[0].rstrip().removesuffix(")"))


def test_every_hint_repeats_the_options_it_depends_on(pytester: pytest.Pytester,
                                                      tmp_path_factory: pytest.TempPathFactory) -> None:
    _project(pytester)
    store = tmp_path_factory.mktemp("store")
    options = [f"--baseline-dir={store}", "--parity-dtypes=bf16", "--parity-seed=3"]
    # missing: the record command names the store, the recipes and the seed of this run
    result = pytester.runpytest("--npu-parity", "--parity-reference=baseline", *options, "-k", "test_a")
    result.assert_outcomes(failed=1, deselected=1)
    command = _hint(result, "record it on a trusted machine with: ")
    assert command[:2] == ["pytest", "--update-baselines"] and command[2:5] == options
    assert command[5:] == [A_ID.replace("fp32", "bf16")]
    _record(pytester, *command[1:])  # what the hint says records exactly what this run looks for
    pytester.runpytest("--npu-parity", "--parity-reference=baseline", *options, "-k", "test_a").assert_outcomes(
        passed=1, deselected=1)
    # stale (another seed): the re-record command repeats the seed this run uses
    result = pytester.runpytest("--npu-parity", *options[:2], "--parity-seed=4", "-k", "test_a")
    result.assert_outcomes(failed=1, deselected=1)
    command = _hint(result, "re-record them on a trusted machine with: ")
    assert command[2:5] == [*options[:2], "--parity-seed=4"]
    _record(pytester, *command[1:])
    pytester.runpytest("--npu-parity", *options[:2], "--parity-seed=4", "-k", "test_a").assert_outcomes(
        passed=1, deselected=1)


LOCALIZE_MODULE = """
import contextlib

import pytest
import torch


@pytest.fixture
def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).eval()


@pytest.fixture
def parity_patches(net):  # the last layer's weight x 1.001 on the target side: a port bug
    @contextlib.contextmanager
    def fault(device):
        saved = net[2].weight.detach().clone()
        with torch.no_grad():
            net[2].weight.mul_(1.001)
        try:
            yield
        finally:
            with torch.no_grad():
                net[2].weight.copy_(saved)
    return fault


def test_net(parity, net):
    parity.check("net", net, torch.linspace(-1, 1, 12).reshape(3, 4))
"""


def test_the_localize_hint_repeats_the_target_reference_and_policy(pytester: pytest.Pytester) -> None:
    _project(pytester, LOCALIZE_MODULE)
    options = ["--parity-device=cpu", "--parity-reference=cpu", "--parity-policy=allclose"]
    result = pytester.runpytest("--npu-parity", *options, "--parity-localize-budget=0")
    result.assert_outcomes(failed=1)
    command = _hint(result, "To localize this check: ")
    assert command[:3] == ["pytest", "--npu-parity", "--parity-localize"] and command[3:6] == options
    forced = pytester.runpytest(*command[1:])
    forced.assert_outcomes(failed=1)
    forced.stdout.fnmatch_lines(["*First divergence: 2 (Linear)*"])


def test_hints_of_a_run_started_below_the_rootdir_change_to_it(pytester: pytest.Pytester) -> None:
    _project(pytester)
    below = pytester.path / "parity_suites"
    os.chdir(below)  # pytester restores the working directory after the test
    result = pytester.runpytest("--npu-parity", "--parity-reference=baseline", "--baseline-dir=../store", "demo")
    result.assert_outcomes(failed=2)
    command = _hint(result, "re-record them on a trusted machine with: ")
    assert command[:3] == ["cd", str(pytester.path), "&&"]
    assert command[3:6] == ["pytest", "--update-baselines", f"--baseline-dir={pytester.path / 'store'}"]
    os.chdir(pytester.path)
    _record(pytester, *command[5:])
    os.chdir(below)
    pytester.runpytest("--npu-parity", "--parity-reference=baseline", "--baseline-dir=../store",
                       "demo").assert_outcomes(passed=2)


def test_empty_and_unmatched_ini_tolerance_patterns_are_warned(pytester: pytest.Pytester) -> None:
    _project(pytester, ini="""
        parity_tolerances =
            : rtol=1e-3
            tnah: rtol=1e-3 # a typo
    """)
    result = pytester.runpytest("--npu-parity", "parity_suites")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines([
        "*PytestConfigWarning: ini parity_tolerances line ': rtol=1e-3' has an empty check pattern and is ignored*",
        "ini parity_tolerances: pattern 'tnah' matched no check of this run *",
    ])


@pytest.mark.parametrize("marker, message", [
    ("rtoll=1e-3", "unknown keyword rtoll= (did you mean rtol=?); known: rtol, atol, *"),
    ("recipes=['fp-32']", "recipes=['fp-32']: unknown recipe(s) 'fp-32'; known: fp32, bf16*"),
    ("policy='goldn'", "policy='goldn': *"),
    ("rtol=-1", "rtol=-1 must be a number >= 0"),
    ("layers='tight'", "layers=: layer check 'tight': give 'off' or a relative L2 limit such as 1e-5"),
    ("train_store='sumary'", "train_store='sumary': train store 'sumary': use one of full, summary"),
])
def test_a_bad_marker_is_a_usage_error_naming_the_test(pytester: pytest.Pytester, marker: str, message: str) -> None:
    _project(pytester, f"""
        import pytest, torch
        @pytest.mark.parity({marker})
        def test_m(parity):
            parity.check("m", torch.tanh, torch.linspace(-2, 2, 10))
    """)
    _usage_error(pytester.runpytest("--npu-parity", "parity_suites"),
                 "ERROR: @pytest.mark.parity: bad arguments",
                 "  parity_suites/demo/test_model.py::test_m[[]*]: " + message.replace("[", "[[]"))


def test_marker_recipes_match_whole_names(pytester: pytest.Pytester) -> None:
    _project(pytester, """
        import pytest, torch
        @pytest.mark.parity(recipes="bf16-weights")
        def test_w(parity):
            parity.check("w", torch.tanh, torch.linspace(-2, 2, 10))
    """)
    result = pytester.runpytest("--npu-parity", "--parity-dtypes=fp32,bf16", "-rs", "parity_suites")
    result.assert_outcomes(skipped=1)  # bf16 is not bf16-weights
    result.stdout.fnmatch_lines(["*none of the recipes [[]'bf16-weights'] is selected by --parity-dtypes*"])
    result = pytester.runpytest("--npu-parity", "--parity-dtypes=fp32,bf16-weights", "-v", "parity_suites")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*test_w[[]bf16-weights] PASSED*"])
