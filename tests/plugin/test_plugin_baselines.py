"""The baseline workflow through pytest: record, compare, stale/missing/corrupt/unsafe files, unused
baselines, interrupted writes and pytest-xdist, all run through pytester on a small project."""
from __future__ import annotations

import os
import shlex
import textwrap
from pathlib import Path

import pytest
from pytester_helpers import edit_module
import torch

import pytest_npu_parity.store.files as store_files  # where the atomic write looks up `os`
from pytest_npu_parity.baselines import CheckBaseline, SuiteStores

# pytester forgets modules first imported during an in-process run; importing what every run needs
# once here (the engine, and hypothesis, which its pytest plugin imports at each terminal summary)
# saves seconds per run.
import hypothesis  # noqa: E402,F401
import pytest_npu_parity.npu  # noqa: E402,F401
import pytest_npu_parity.runner  # noqa: E402,F401


def _import_what_an_optimizer_step_imports() -> None:
    """AdamW's first step imports torch._dynamo (and, through it, a module that registers a
    TORCH_LIBRARY, which cannot be imported twice): do it once here, outside any in-process run."""
    weight = torch.nn.Parameter(torch.ones(1))
    weight.sum().backward()
    torch.optim.AdamW([weight]).step()


_import_what_an_optimizer_step_imports()

# A seeded nn.Linear and a function. SCALE feeds the input (changing it makes the baseline stale);
# SHIFT changes the function's result but neither its input nor its identity (a changed computation).
MODEL_TEST = """
import pytest
import torch

SCALE = 1.0
SHIFT = 0.0

@pytest.fixture
def layer():
    torch.manual_seed(0)
    return torch.nn.Linear(8, 4).eval()

def test_linear(parity, layer):
    x = torch.linspace(-1, 1, 24).reshape(3, 8) * SCALE
    parity.check("linear", layer, x)

def shifted_tanh(x):
    return torch.tanh(x) + SHIFT

def test_tanh(parity):
    parity.check("tanh", shifted_tanh, torch.linspace(-2, 2, 10))
"""

LINEAR_FILE = "baselines/demo/test_model/test_linear.fp32.safetensors"
TANH_FILE = "baselines/demo/test_model/test_tanh.fp32.safetensors"
LINEAR_ID = "parity_suites/demo/test_model.py::test_linear[fp32]"
TANH_ID = "parity_suites/demo/test_model.py::test_tanh[fp32]"
# How the summary and failure messages name a CPU baseline: device, date, versions, recipe.
PROVENANCE = f"cpu (*) · ????-??-?? · torch {torch.__version__} · *recipe fp32"  # torch_npu follows torch where installed


def _esc(text: str) -> str:
    """``text`` as a literal fnmatch pattern ('[' starts a character class there)."""
    return text.replace("[", "[[]")


def _project(pytester: pytest.Pytester, recipes: str = "fp32") -> Path:
    """A project whose testpaths name the unit tests, with one parity suite ``parity_suites/demo``."""
    pytester.makeini(f"""
        [pytest]
        testpaths = tests
        parity_dtypes = {recipes}
    """)
    (pytester.path / "tests").mkdir()
    (pytester.path / "tests" / "test_unit.py").write_text("def test_unit():\n    assert True\n")
    return _suite(pytester, "demo")


def _suite(pytester: pytest.Pytester, name: str, module: str = "test_model") -> Path:
    suite = pytester.path / "parity_suites" / name
    suite.mkdir(parents=True, exist_ok=True)
    module = suite / f"{module}.py"
    module.write_text(textwrap.dedent(MODEL_TEST))
    return module




def _record(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    result = pytester.runpytest("--update-baselines", *args)
    assert result.ret == 0, result.stdout.str()
    return result


def test_update_without_path_records_the_parity_suites_then_compares_and_keeps_unchanged_files(
        pytester: pytest.Pytester) -> None:
    _project(pytester)
    result = pytester.runpytest("--update-baselines", "-v")
    # testpaths names tests/, but a bare --update-baselines records the parity suites (ini parity_paths)
    result.assert_outcomes(passed=2)
    assert "test_unit" not in result.stdout.str()
    result.stdout.fnmatch_lines([
        "npu-parity: * recording baselines *",
        "*2 checks: 2 recorded*",
        "baselines: 2 created (2 files under baselines)",
        _esc(f"  created      {LINEAR_FILE}  <- {LINEAR_ID}"),
        _esc(f"  created      {TANH_FILE}  <- {TANH_ID}"),
    ])
    files = [pytester.path / LINEAR_FILE, pytester.path / TANH_FILE]
    before = [(p.stat().st_mtime_ns, p.read_bytes()) for p in files]

    # auto mode uses the stored baseline and says which one
    result = pytester.runpytest("--npu-parity", "parity_suites")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines([f"reference: 2 checks vs baseline {PROVENANCE}"])
    assert "live CPU run" not in result.stdout.str()

    # recording the same computation again rewrites nothing
    result = _record(pytester)
    result.stdout.fnmatch_lines(["baselines: 2 unchanged (2 files under baselines)"])
    assert "  created" not in result.stdout.str() and "  changed" not in result.stdout.str()
    assert [(p.stat().st_mtime_ns, p.read_bytes()) for p in files] == before


def test_auto_reference_falls_back_to_a_live_cpu_run_without_a_baseline(pytester: pytest.Pytester) -> None:
    _project(pytester)
    result = pytester.runpytest("--npu-parity", "parity_suites")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["reference: 2 checks vs a live CPU run"])
    assert not (pytester.path / "baselines").exists()


def test_changed_computation_fails_against_the_named_baseline_then_records_as_changed(
        pytester: pytest.Pytester) -> None:
    module = _project(pytester)
    _record(pytester)
    edit_module(module, "SHIFT = 0.0", "SHIFT = 1e-3")

    result = pytester.runpytest("--npu-parity", "parity_suites")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        f"*Parity check 'tanh' failed (recipe fp32, target cpu (*) vs baseline {TANH_FILE} — {PROVENANCE})*",
        "*Mismatched elements: 10 / 10 (100.0%)*",
    ])

    result = _record(pytester)
    result.stdout.fnmatch_lines([
        "baselines: 1 changed, 1 unchanged (2 files under baselines)",
        _esc(f"  changed      {TANH_FILE}  <- {TANH_ID}"),
    ])
    pytester.runpytest("--npu-parity", "--parity-reference=baseline", "parity_suites").assert_outcomes(passed=2)


def test_changed_input_makes_the_baseline_stale_with_the_reason(pytester: pytest.Pytester) -> None:
    module = _project(pytester)
    _record(pytester)
    edit_module(module, "SCALE = 1.0", "SCALE = 2.0")

    result = pytester.runpytest("--npu-parity", "parity_suites")  # auto: a stale baseline is no fallback
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    result.stdout.fnmatch_lines([
        f"E *StaleBaselineError: baseline {LINEAR_FILE} is stale for check 'linear': input hash changed "
        f"(recorded *, now *): sum of squares of * differs: recorded *, now *. It was recorded on {PROVENANCE}. "
        f"Re-record it on a trusted machine with: "
        f"pytest --update-baselines {_esc(shlex.quote(LINEAR_ID))}",
        "baselines not usable: 1 stale",
        _esc(f"  stale  {LINEAR_ID} check 'linear' ({LINEAR_FILE})"),
        _esc(f"re-record them on a trusted machine with: pytest --update-baselines {shlex.quote(LINEAR_ID)}"),
    ])
    # the failure is shown from the test's line, not from the baseline store's internals
    assert "pytest_npu_parity/baselines.py" not in out and "pytest_npu_parity/runner.py" not in out
    assert "pytest_npu_parity/store/" not in out
    assert "parity.check(\"linear\", layer, x)" in out


def test_missing_baseline_fails_with_the_command_that_records_it(pytester: pytest.Pytester) -> None:
    _project(pytester)
    result = pytester.runpytest("--npu-parity", "--parity-reference=baseline", "parity_suites")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines([
        f"E *MissingBaselineError: no baseline for {_esc(LINEAR_ID)} (looked for {LINEAR_FILE}); "
        "record it on a trusted machine with: pytest --update-baselines *",
        "baselines not usable: 2 missing",
    ])
    line = next(x for x in result.stdout.lines if "MissingBaselineError" in x and "test_linear" in x)
    command = shlex.split(line.partition("record it on a trusted machine with: ")[2])
    assert command[:2] == ["pytest", "--update-baselines"]

    # the quoted command records exactly that baseline
    result = _record(pytester, *command[1:])
    result.assert_outcomes(passed=1)
    assert (pytester.path / LINEAR_FILE).is_file() and not (pytester.path / TANH_FILE).exists()
    result = pytester.runpytest("--npu-parity", "--parity-reference=baseline", "parity_suites")
    result.assert_outcomes(passed=1, failed=1)


def test_truncated_baseline_fails_naming_the_file_and_is_rerecorded(pytester: pytest.Pytester) -> None:
    _project(pytester)
    _record(pytester)
    path = pytester.path / LINEAR_FILE
    path.write_bytes(path.read_bytes()[:100])

    result = pytester.runpytest("--npu-parity", "parity_suites")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        f"E *CorruptBaselineError: baseline {LINEAR_FILE} is truncated: its header needs * bytes, "
        "the file has 100; delete it and re-record",
        "baselines not usable: 1 corrupt",
    ])
    result = _record(pytester)
    result.stdout.fnmatch_lines(["baselines: 1 changed, 1 unchanged (2 files under baselines)"])
    pytester.runpytest("--npu-parity", "--parity-reference=baseline", "parity_suites").assert_outcomes(passed=2)


@pytest.mark.parametrize("mode", ["--npu-parity", "--update-baselines"])
def test_pickle_files_in_the_baseline_folder_are_refused(pytester: pytest.Pytester, mode: str) -> None:
    _project(pytester)
    folder = pytester.path / "baselines" / "demo" / "test_model"
    folder.mkdir(parents=True)
    torch.save({"linear": torch.zeros(3)}, folder / "test_linear.fp32.pt")
    torch.save({"tanh": torch.zeros(3)}, folder / "test_tanh.fp32.safetensors")  # a zip under a safe name
    result = pytester.runpytest(mode, "parity_suites")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([
        "*refusing to run: pickle-format files in the baseline store*",
        f"*{folder / 'test_linear.fp32.pt'}",
        f"*{folder / 'test_tanh.fp32.safetensors'}",
    ])
    assert (folder / "test_tanh.fp32.safetensors").read_bytes()[:2] == b"PK"  # left as it was


INTERRUPT_ON_RENAME = """
import os
import types

import pytest

import pytest_npu_parity.store.files as store


class _InterruptedOs(types.ModuleType):
    # the store's view of `os`: the process is interrupted after the temporary file is written
    # and fsynced, before it is renamed over the old baseline
    def __getattr__(self, name):
        return getattr(os, name)

    @staticmethod
    def replace(src, dst):
        raise KeyboardInterrupt("interrupted before the rename")


@pytest.fixture(autouse=True)
def interrupt_on_rename(monkeypatch):
    monkeypatch.setattr(store, "os", _InterruptedOs("os"))
"""


def test_interrupted_write_leaves_the_old_baseline_intact(pytester: pytest.Pytester) -> None:
    module = _project(pytester)
    _record(pytester)
    old = (pytester.path / TANH_FILE).read_bytes()
    edit_module(module, "SHIFT = 0.0", "SHIFT = 0.5")
    conftest = pytester.path / "parity_suites" / "conftest.py"
    conftest.write_text(INTERRUPT_ON_RENAME)

    try:
        result = pytester.runpytest("--update-baselines", "parity_suites/demo/test_model.py::test_tanh",
                                    no_reraise_ctrlc=True)
    finally:  # the interrupted run skipped the teardown that undoes the conftest's patch
        store_files.os = os
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(["*KeyboardInterrupt*", "*interrupted before the rename*"])
    assert (pytester.path / TANH_FILE).read_bytes() == old
    assert sorted(p.name for p in (pytester.path / TANH_FILE).parent.iterdir()) == [
        "test_linear.fp32.safetensors", "test_tanh.fp32.safetensors"]  # no temporary file left behind
    assert SuiteStores(pytester.path / "baselines").load(TANH_ID).checks["tanh"].meta["recipe"] == "fp32"

    # A killed writer (no Python cleanup) can leave its temporary file: a compare run names it, the
    # next record run (holding the store lock, so no live writer owns it) removes it and says so.
    conftest.unlink()
    leftover = (pytester.path / TANH_FILE).parent / ".test_tanh.fp32.safetensors.k1ll3d.tmp"
    leftover.write_bytes(b"partial")
    result = pytester.runpytest("--npu-parity", "parity_suites")
    result.stdout.fnmatch_lines(["baselines: 1 temporary file (7 bytes) left by an interrupted record run; "
                                 "the next `pytest --update-baselines` removes them:",
                                 "  baselines/demo/test_model/.test_tanh.fp32.safetensors.k1ll3d.tmp (7 bytes)"])
    assert leftover.exists()
    result = _record(pytester)
    result.stdout.fnmatch_lines(["baselines: 1 changed, 1 unchanged (2 files under baselines)",
                                 "baselines: removed 1 temporary file (7 bytes) left by an interrupted record run:",
                                 "  baselines/demo/test_model/.test_tanh.fp32.safetensors.k1ll3d.tmp (7 bytes)"])
    assert "unused (no collected" not in result.stdout.str() and not leftover.exists()


def test_failed_test_in_record_mode_writes_no_baseline(pytester: pytest.Pytester) -> None:
    module = _project(pytester)
    _record(pytester)
    old = (pytester.path / TANH_FILE).read_bytes()
    edit_module(module, 'parity.check("tanh", shifted_tanh, torch.linspace(-2, 2, 10))',
          'parity.check("tanh", shifted_tanh, torch.linspace(-2, 2, 10) * 3)\n    assert False, "after the check"')
    result = pytester.runpytest("--update-baselines")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "baselines: 1 unchanged, 1 not written (2 files under baselines)",
        _esc(f"  not written  {TANH_FILE}  <- {TANH_ID} (the test failed)"),
    ])
    assert (pytester.path / TANH_FILE).read_bytes() == old


def test_unused_baseline_is_reported_and_pruned_only_by_a_full_update(pytester: pytest.Pytester) -> None:
    module = _project(pytester)
    module.write_text(textwrap.dedent(MODEL_TEST)
                      + "\ndef test_old(parity):\n    parity.check('old', torch.sin, torch.ones(2))\n")
    _record(pytester)
    orphan = pytester.path / "baselines/demo/test_model/test_old.fp32.safetensors"
    assert orphan.is_file()
    module.write_text(textwrap.dedent(MODEL_TEST))  # test_old is gone
    os.utime(module, ns=(module.stat().st_atime_ns, module.stat().st_mtime_ns + 2_000_000_000))

    # reported on a full run, also when no baseline is read (reference cpu) ...
    result = pytester.runpytest("--npu-parity", "--parity-reference=cpu", "parity_suites")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines([
        "baselines: 1 unused (no collected test maps to them; `pytest --update-baselines` on a full run prunes them):",
        "  baselines/demo/test_model/test_old.fp32.safetensors",
    ])
    # ... but not judged when the run does not cover its test file
    assert "unused (no collected" not in pytester.runpytest("--npu-parity", "tests").stdout.str()

    # filtered record runs keep it
    for args in (["-k", "linear"], ["parity_suites/demo/test_model.py"]):
        result = _record(pytester, *args)
        assert "unused (no collected" not in result.stdout.str() and orphan.exists(), args

    result = _record(pytester)
    result.stdout.fnmatch_lines(["baselines: pruned 1 unused (no collected test maps to them):",
                                 "  baselines/demo/test_model/test_old.fp32.safetensors"])
    assert not orphan.exists() and (pytester.path / LINEAR_FILE).exists() and (pytester.path / TANH_FILE).exists()


def test_a_default_full_update_keeps_the_baselines_of_the_opt_in_fp16_recipe(pytester: pytest.Pytester) -> None:
    _project(pytester)  # ini parity_dtypes = fp32, as the default run leaves fp16 out
    _record(pytester)
    result = _record(pytester, "--parity-dtypes", "fp16", "parity_suites")
    fp16_file = pytester.path / LINEAR_FILE.replace(".fp32.", ".fp16.")
    assert fp16_file.is_file(), result.stdout.str()
    result = _record(pytester)  # a full run of the default recipes: fp16 is out of its scope
    assert "unused" not in result.stdout.str() and fp16_file.is_file()
    result = pytester.runpytest("--npu-parity", "--parity-reference=baseline", "--parity-dtypes", "fp16", "parity_suites")
    result.assert_outcomes(passed=2)
    # once the test is gone, a full update of a run that includes fp16 prunes its file
    pytester.makeini("""
        [pytest]
        testpaths = tests
        parity_dtypes = fp32,fp16
    """)
    module = pytester.path / "parity_suites" / "demo" / "test_model.py"
    module.write_text(textwrap.dedent(MODEL_TEST).split("def test_linear")[0] + "def shifted_tanh(x):\n    return x\n"
                      + "\ndef test_tanh(parity):\n    parity.check('tanh', shifted_tanh, torch.linspace(-2, 2, 10))\n")
    os.utime(module, ns=(module.stat().st_atime_ns, module.stat().st_mtime_ns + 2_000_000_000))
    result = _record(pytester)
    result.stdout.fnmatch_lines(["baselines: pruned 2 unused (no collected test maps to them):"])
    assert not fp16_file.exists() and not (pytester.path / LINEAR_FILE).exists()


def test_update_of_one_suite_leaves_the_others_alone(pytester: pytest.Pytester,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    _project(pytester)
    _suite(pytester, "other", "test_other")  # module basenames are unique without __init__.py files
    _record(pytester)
    other = pytester.path / "baselines/other/test_other/test_linear.fp32.safetensors"
    assert other.is_file()

    result = _record(pytester, "parity_suites/demo")  # a path, as users type it
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["baselines: 2 unchanged (2 files under baselines)"])
    assert "pruned" not in result.stdout.str() and other.is_file()

    # a bare --update-baselines started inside a suite records that suite
    monkeypatch.chdir(pytester.path / "parity_suites" / "other")
    result = _record(pytester, "-v")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["test_other.py::test_linear?fp32? PASSED*", "test_other.py::test_tanh?fp32? PASSED*",
                                 "baselines: 2 unchanged (2 files under */baselines)"])
    assert "test_model.py" not in result.stdout.str() and "pruned" not in result.stdout.str()
    assert (pytester.path / LINEAR_FILE).is_file()


def test_baseline_dir_relative_to_the_invocation_dir_or_absolute(pytester: pytest.Pytester,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path_factory: pytest.TempPathFactory) -> None:
    _project(pytester)
    monkeypatch.chdir(pytester.path / "tests")  # a command-line path is relative to where pytest runs
    _record(pytester, "--baseline-dir", "../store")
    assert (pytester.path / "store/demo/test_model/test_linear.fp32.safetensors").is_file()
    assert not (pytester.path / "tests/store").exists() and not (pytester.path / "baselines").exists()

    absolute = tmp_path_factory.mktemp("elsewhere") / "store"
    _record(pytester, "--baseline-dir", str(absolute))
    assert (absolute / "demo/test_model/test_tanh.fp32.safetensors").is_file()
    result = pytester.runpytest("--npu-parity", "--parity-reference=baseline", "--baseline-dir", str(absolute),
                                str(pytester.path / "parity_suites"))
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines([f"npu-parity: * baselines {absolute}"])

    # an ini path is relative to the rootdir, wherever pytest runs
    pytester.makeini("""
        [pytest]
        testpaths = tests
        parity_dtypes = fp32
        parity_baseline_dir = ini_store
    """)
    _record(pytester)
    assert (pytester.path / "ini_store/demo/test_model/test_linear.fp32.safetensors").is_file()


def test_plugin_loads_without_pytest_xdist(pytester: pytest.Pytester) -> None:
    _project(pytester)
    result = pytester.runpytest("-p", "no:xdist", "--npu-parity", "parity_suites")
    result.assert_outcomes(passed=2)
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()


def test_xdist_update_run_writes_consistent_files_and_counts_every_worker(pytester: pytest.Pytester) -> None:
    pytest.importorskip("xdist")
    _project(pytester, recipes="fp32,bf16")
    store = SuiteStores(pytester.path / "baselines")
    orphan_id = "parity_suites/demo/test_model.py::test_removed[fp32]"
    store.write(orphan_id, {"gone": CheckBaseline("gone", {"": torch.ones(2)})}, {"device_type": "cpu"})

    result = pytester.runpytest("--update-baselines", "-n", "2")
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines([
        "*2 workers*",
        "*4 checks: 4 recorded*",
        "baselines: 4 created (4 files under baselines)",
        "baselines: pruned 1 unused (no collected test maps to them):",
        "  baselines/demo/test_model/test_removed.fp32.safetensors",
    ])
    folder = pytester.path / "baselines/demo/test_model"
    assert sorted(p.name for p in folder.iterdir()) == [
        "test_linear.bf16.safetensors", "test_linear.fp32.safetensors",
        "test_tanh.bf16.safetensors", "test_tanh.fp32.safetensors"]  # no temporary files
    for test_id in (LINEAR_ID, TANH_ID, LINEAR_ID.replace("fp32", "bf16"), TANH_ID.replace("fp32", "bf16")):
        baseline = store.load(test_id)  # verifies the checksum of every file
        assert baseline.test_id == test_id and baseline.provenance["device_type"] == "cpu"
    result = pytester.runpytest("--npu-parity", "--parity-reference=baseline", "parity_suites")
    result.assert_outcomes(passed=4)


def test_every_check_of_a_test_with_a_corrupt_baseline_fails(pytester: pytest.Pytester) -> None:
    _project(pytester)
    module = _suite(pytester, "demo")
    module.write_text(textwrap.dedent("""
        import pytest
        import torch

        def test_two_checks(parity):
            try:
                parity.check("first", torch.sin, torch.ones(3))
            except Exception as exc:  # the test goes on after the first failure ...
                assert "is corrupt" in str(exc)
            parity.check("second", torch.cos, torch.ones(3))  # ... without a quiet fallback to a CPU run
    """))
    _record(pytester)
    path = pytester.path / "baselines/demo/test_model/test_two_checks.fp32.safetensors"
    path.write_bytes(b"not a baseline at all")
    result = pytester.runpytest("--npu-parity", "parity_suites")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["E *CorruptBaselineError: baseline * is corrupt: not a safetensors file*",
                                 "baselines not usable: 2 corrupt"])


TRAIN_TEST = """
import pytest
import torch

@pytest.fixture
def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 2))

def test_step(parity, model):
    x = torch.linspace(-1, 1, 256).reshape(4, 64)
    parity.train_step("step", model, {"input": x}, loss_fn=lambda out: out.square().mean())

@pytest.mark.parity(train_store="full")
def test_step_full(parity, model):
    x = torch.linspace(-1, 1, 256).reshape(4, 64)
    parity.train_step("step", model, {"input": x}, loss_fn=lambda out: out.square().mean())
"""


def test_ini_train_store_summary_records_large_leaves_compactly(pytester: pytest.Pytester) -> None:
    pytester.makeini("""
        [pytest]
        parity_dtypes = fp32
        parity_train_store = summary min_numel=1024 samples=128 # keep training baselines small in git
    """)
    suite = pytester.path / "parity_suites" / "demo"
    suite.mkdir(parents=True)
    (suite / "test_train.py").write_text(textwrap.dedent(TRAIN_TEST))
    _record(pytester)
    compact = pytester.path / "baselines/demo/test_train/test_step.fp32.safetensors"
    full = pytester.path / "baselines/demo/test_train/test_step_full.fp32.safetensors"
    assert compact.stat().st_size < full.stat().st_size / 2  # the 64x64 weight and its gradient: 128 values each
    pytester.runpytest("--npu-parity", "--parity-reference=baseline", "parity_suites").assert_outcomes(passed=2)
    # a bad setting is one usage error naming the key, before any test runs
    pytester.makeini("[pytest]\nparity_train_store = summary samples=lots\n")
    result = pytester.runpytest("--npu-parity", "parity_suites")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*ini parity_train_store='summary samples=lots': train store *: samples='lots' "
                                 "is not an integer*"])
