"""Tests of pytest_npu_parity.npu: version matrix, CANN detection, failure sentences, compat layer.

NPU-specific branches run against fakes (tests/fakes): a stub torch_npu package in a subprocess
(so this process's real torch never sees it), a fake CANN toolkit with real-format version files,
and a fake npu-smi.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import itertools
import json
import logging
import sys
from pathlib import Path

import pytest
import torch
from locations import TESTS

from pytest_npu_parity import ascend_release, npu
from pytest_npu_parity.runtime.npu import cann as npu_cann
from pytest_npu_parity.runtime.npu import diagnosis as npu_diagnosis
from pytest_npu_parity.runtime.npu import launcher as npu_launcher
from pytest_npu_parity.runtime.npu import ops as npu_ops

_FAKES_PATH = TESTS / "fakes" / "fake_env.py"
_spec = importlib.util.spec_from_file_location("npu_parity_fake_env", _FAKES_PATH)
fake_env = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fake_env)

TORCH_BASE = npu.base_version(torch.__version__)
LIBHCCL = "libhccl.so: cannot open shared object file: No such file or directory"
SET_ENV = "source CANN's set_env.sh (e.g. `source /usr/local/Ascend/ascend-toolkit/set_env.sh`)"
#: With no toolkit installed, the fix names the set_env.sh the stub's wheel generation documents.
NO_CANN_SET_ENV = ascend_release.set_env_fix(None, TORCH_BASE)
NO_TORCH_NPU = npu._dist_version("torch_npu") is None  # installed? (find_spec says None once it is quarantined)


# --------------------------------------------------------------------------------------------
# Versions and the matrix
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("version, expected", [
    ("2.5.1", "2.5.1"), ("2.5.1+cpu", "2.5.1"), ("2.5.1.post1", "2.5.1"),
    ("2.1.0.post13+git1a2b", "2.1.0"), ("2.1.0.rc1", "2.1.0"), ("garbage", None), (None, None),
])
def test_base_version(version, expected):
    assert npu.base_version(version) == expected


@pytest.mark.parametrize("version, expected", [
    ("8.2.RC1", "8.2.RC1"), ("8.2.rc1", "8.2.RC1"), ("8.1.RC1.alpha001", "8.1.RC1"),
    ("8.5.0", "8.5.0"), ("8.0.T63", None), (None, None),
])
def test_cann_release(version, expected):
    assert npu.cann_release(version) == expected


def test_matrix_holds_the_seed_pin_and_the_ascend_rows():
    rows = npu.documented_rows(cann="8.2.RC1")
    assert ("2.5.1", "2.5.1") in {(r.torch, r.torch_npu) for r in rows}  # seed guide §2.2
    assert ("2.5.1", "2.5.1.post1") in {(r.torch, r.torch_npu) for r in rows}  # Ascend table
    assert all(npu.base_version(r.torch_npu) == r.torch for r in npu.VERSION_MATRIX)


def test_matrix_notes_cite_both_sources_where_guide_and_ascend_table_disagree():
    seed_pin = npu.matrix_notes("2.5.1", "2.5.1", "8.2.RC1")
    assert len(seed_pin) == 1 and "2.5.1.post1" in seed_pin[0] and "§2.2" in seed_pin[0]
    assert "Ascend/pytorch README.zh.md" in seed_pin[0]
    old_torch = npu.matrix_notes("2.4.0", "2.4.0.post4", "8.1.RC1")
    assert len(old_torch) == 1 and "CANN 8.0.0" in old_torch[0] and "2.4.0.post4" in old_torch[0]
    assert "move to torch 2.5.1" in old_torch[0]
    # rows where the two sources agree carry no note
    assert npu.matrix_notes("2.5.1", "2.5.1.post1", "8.2.RC1") == []
    assert npu.matrix_notes("2.5.1", "2.5.1", "8.1.RC1") == []
    assert npu.matrix_notes("2.6.0", "2.6.0", "8.2.RC1") == []
    assert npu.matrix_notes(None, None, None) == []
    # and every row a note names is in the matrix
    assert npu.documented_rows(cann="8.1.RC1", torch_npu="2.4.0.post4")
    assert npu.documented_rows(cann="8.2.RC1", torch_npu="2.5.1.post1")


@pytest.mark.parametrize("torch_v, npu_v, cann", [
    ("2.5.1", "2.5.1", "8.2.RC1"),              # the seed's row
    ("2.5.1+cpu", "2.5.1.post1", "8.2.RC1"),    # Ascend's row, local labels ignored
    ("2.5.1", "2.5.1.post1", "8.2.RC1.alpha001"),
    ("2.5.1", "2.5.1.post1", "9.9.RC1"),        # CANN release unknown to the matrix: no verdict
    ("2.5.1", "2.5.1.post1", None),
    ("2.14.1", None, None),
    (None, None, None),
])
def test_check_version_matrix_accepts(torch_v, npu_v, cann):
    assert npu.check_version_matrix(torch_v, npu_v, cann) == []


def test_check_version_matrix_torch_vs_torch_npu():
    problems = npu.check_version_matrix("2.4.0", "2.5.1", "8.2.RC1")
    assert len(problems) == 1
    assert "torch_npu 2.5.1 is built for torch 2.5.1, but torch 2.4.0 is installed" in problems[0]
    assert "install torch 2.5.1" in problems[0]


def test_check_version_matrix_cann_vs_torch_npu():
    (problem,) = npu.check_version_matrix("2.5.1", "2.5.1.post1", "8.3.RC1")
    assert "CANN 8.3.RC1 and torch_npu 2.5.1.post1 are not a documented pair" in problem
    assert "documented for CANN 8.2.RC1" in problem
    assert "torch 2.6.0 + torch_npu 2.6.0.post3" in problem  # a row that does work with 8.3.RC1


def test_check_version_matrix_cann_too_old():
    # seed §10.6: "CANN 7.x + torch_npu 2.5.1 (CANN too old)"
    (problem,) = npu.check_version_matrix("2.5.1", "2.5.1", "7.0.0")
    assert "CANN 7.0.0 and torch_npu 2.5.1 are not a documented pair" in problem


def test_check_version_matrix_cann_vs_torch_without_torch_npu():
    (problem,) = npu.check_version_matrix("2.5.1", None, "8.0.RC1")
    assert "CANN 8.0.RC1 has no torch_npu release for torch 2.5.1" in problem


# --------------------------------------------------------------------------------------------
# CANN
# --------------------------------------------------------------------------------------------

@pytest.fixture
def no_default_toolkit(monkeypatch, tmp_path):
    """Hide the host's own CANN (env vars and default paths) from find_cann."""
    for var in npu.TOOLKIT_ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(npu_cann, "DEFAULT_TOOLKIT_HOMES", (str(tmp_path / "no-such-toolkit"),))


def test_cann_version_from_fake_toolkit_version_cfg(no_default_toolkit):
    info = npu.find_cann(fake_env.TOOLKIT_HOME)
    assert info.version == "8.2.RC1"
    assert info.source == str(fake_env.TOOLKIT_HOME / "version.cfg")
    assert npu.cann_version(fake_env.TOOLKIT_HOME / "version.cfg") == "8.2.RC1"


def test_cann_version_from_install_info_only(no_default_toolkit, tmp_path):
    home = tmp_path / "latest"
    (home / "aarch64-linux").mkdir(parents=True)
    (home / "aarch64-linux" / "ascend_toolkit_install.info").write_text(
        "package_name=Ascend-cann-toolkit\nversion=8.3.RC1\ninnerversion=V100R001C23SPC001B231\n"
        "arch=aarch64\nos=linux\n", encoding="utf-8")
    info = npu.find_cann(home)
    assert (info.version, Path(info.source).name) == ("8.3.RC1", "ascend_toolkit_install.info")


def test_cann_version_old_format_and_runtime_fallback(no_default_toolkit, tmp_path):
    (tmp_path / "version.cfg").write_text(
        "# version: 1.0\nruntime_running_version=[1.83.T8.0.B128:CANN-1.83]\n", encoding="utf-8")
    assert npu.cann_version(tmp_path) == "1.83"


def test_cann_version_from_environment_variable(no_default_toolkit, monkeypatch):
    assert npu.cann_version() is None
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(fake_env.TOOLKIT_HOME))
    assert npu.cann_version() == "8.2.RC1"


@pytest.mark.parametrize("content", ["", "# version: 1.0\n", "runtime_running_version=[]\n",
                                     "\xff\xfe garbage \x00"])
def test_cann_version_malformed_is_none(no_default_toolkit, tmp_path, content):
    (tmp_path / "version.cfg").write_text(content, encoding="utf-8", errors="replace")
    assert npu.cann_version(tmp_path) is None


def test_cann_missing_sentence_names_paths_and_fix():
    sentence = npu.cann_missing_sentence("2.5.1.post1")
    assert sentence.startswith("CANN toolkit not found")
    assert "/usr/local/Ascend/ascend-toolkit/latest" in sentence
    assert "install the CANN toolkit 8.2.RC1 matching torch_npu and " + SET_ENV in sentence


# --------------------------------------------------------------------------------------------
# Failure sentences
# --------------------------------------------------------------------------------------------

def _chained(outer: BaseException, inner: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException as exc:
            raise outer from exc
    except BaseException as exc:
        return exc


AUTOLOAD_MESSAGE = ("Failed to load the backend extension: torch_npu. You can disable extension "
                    "auto-loading with TORCH_DEVICE_BACKEND_AUTOLOAD=0.")


@pytest.fixture
def toolkit_layout(monkeypatch):
    """The fake CANN ≤ 8.3 toolkit is the installed one: sentences name its layout's set_env.sh."""
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(fake_env.TOOLKIT_HOME))


def test_sentence_libhccl_missing(toolkit_layout):
    assert npu.explain_import_error(ImportError(LIBHCCL)) == (
        f"torch_npu is not importable: libhccl.so not found — {SET_ENV}")


def test_sentence_libascendcl_missing(toolkit_layout):
    exc = ImportError("libascendcl.so: cannot open shared object file: No such file or directory")
    assert npu.explain_import_error(exc) == (
        f"torch_npu is not importable: libascendcl.so not found — {SET_ENV}")


def test_sentence_torch_npu_library_missing_points_at_reinstall():
    exc = ImportError("libtorch_npu.so: cannot open shared object file: No such file or directory")
    sentence = npu.explain_import_error(exc)
    assert sentence.startswith("torch_npu is not importable: libtorch_npu.so not found — reinstall")
    assert "one row of the version matrix" in sentence


def test_sentence_two_accelerators_cuda(monkeypatch):
    monkeypatch.setattr(npu_diagnosis, "_torch_pin_of_torch_npu", lambda: (None, None))  # no wheel metadata to read
    exc = RuntimeError("Two accelerators cannot be used at the same time in PyTorch: npu and cuda. "
                       "You can install the cpu version of PyTorch to use your npu device, or use "
                       "the cuda device with 'export TORCH_DEVICE_BACKEND_AUTOLOAD=0'.")
    assert npu.explain_import_error(exc).startswith(
        "Two accelerators cannot be used at the same time: torch_npu is installed beside a CUDA "
        "build of torch — install the CPU build of torch that matches torch_npu")


@pytest.mark.parametrize(("wheel", "pin", "fix"), [
    ("2.5.1", "2.5.1+cpu", "torch_npu 2.5.1 pins torch==2.5.1+cpu: install it, `pip install torch==2.5.1+cpu "
                           "--index-url https://download.pytorch.org/whl/cpu`"),
    ("2.14.0", "2.14.0.*", "torch_npu 2.14.0 accepts this build (it pins torch==2.14.0.*) but refuses to load where a "
                           "CUDA device is visible: hide the GPUs from this process (`export CUDA_VISIBLE_DEVICES=`) "
                           "or install `pip install torch==2.14.0+cpu"),
])
def test_sentence_two_accelerators_names_the_build_the_installed_wheel_pins(monkeypatch, wheel, pin, fix):
    monkeypatch.setattr(npu_diagnosis, "_torch_pin_of_torch_npu", lambda: (wheel, pin))
    exc = RuntimeError("Two accelerators cannot be used at the same time in PyTorch: npu and cuda.")
    sentence = npu.explain_import_error(exc)
    assert fix in sentence and "2.5.1+cpu" not in sentence.replace(fix, "") if wheel == "2.14.0" else fix in sentence


def test_sentence_numpy_2_abi_error_gives_the_checklist_pin():
    exc = ImportError("numpy.core.multiarray failed to import")
    assert npu.explain_import_error(exc) == (
        "torch_npu is not importable: ImportError: numpy.core.multiarray failed to import — the migration "
        "checklist (§0.3) pins numpy 1.26.4 for older CANN releases — pip install numpy==1.26.4")


def test_sentence_two_accelerators_registered_twice():
    exc = RuntimeError("Two accelerators cannot be used at the same time in PyTorch: npu and npu")
    sentence = npu.explain_import_error(exc)
    assert "registered twice" in sentence
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in sentence


def test_sentence_autoload_failure_names_cause_and_escape(toolkit_layout):
    exc = _chained(RuntimeError(AUTOLOAD_MESSAGE), ImportError(LIBHCCL))
    assert npu.explain_import_error(exc) == (
        f"Failed to load the backend extension: torch_npu (libhccl.so not found) — {SET_ENV}, or "
        "set TORCH_DEVICE_BACKEND_AUTOLOAD=0 to use torch without the NPU")


def test_sentence_autoload_failure_with_unknown_cause_quotes_it():
    exc = _chained(RuntimeError(AUTOLOAD_MESSAGE), AttributeError("module has no attribute 'x'"))
    sentence = npu.explain_import_error(exc)
    assert sentence.startswith("Failed to load the backend extension: torch_npu "
                               "(AttributeError: module has no attribute 'x')")
    assert sentence.endswith("or set TORCH_DEVICE_BACKEND_AUTOLOAD=0 to use torch without the NPU")


def test_sentence_glibcxx_means_version_mismatch():
    exc = OSError("libstdc++.so.6: version `GLIBCXX_3.4.29' not found (required by libtorch_npu.so)")
    sentence = npu.explain_import_error(exc)
    assert "GLIBCXX_3.4.29" in sentence
    assert "torch, torch_npu and CANN versions do not match" in sentence


def test_sentence_unknown_error_is_quoted():
    sentence = npu.explain_import_error(ValueError("boom"))
    assert sentence.startswith("torch_npu is not importable: ValueError: boom — check that torch, "
                               "torch_npu and CANN match the version matrix")


def test_version_mismatch_sentence():
    sentence = npu.version_mismatch_sentence("2.14.1", "2.5.1.post1")
    assert sentence.startswith("torch_npu 2.5.1.post1 is built for torch 2.5.1, but torch 2.14.1 "
                               "is installed — install torch 2.5.1")


# --------------------------------------------------------------------------------------------
# npu_status and the compat layer in this process (no torch_npu installed here)
# --------------------------------------------------------------------------------------------

@pytest.mark.skipif(not NO_TORCH_NPU, reason="torch_npu is installed in this environment")
def test_npu_status_without_torch_npu_is_cached_and_imports_nothing():
    status = npu.npu_status(refresh=True)
    assert status.available is False
    assert status.reason.startswith("torch_npu is not installed — install")
    assert (status.torch_npu_version, status.device_count, status.device_name) == (None, 0, None)
    assert npu.npu_status() is status
    assert npu.npu_status(refresh=True) is not status
    assert "torch_npu" not in sys.modules


@pytest.mark.skipif(not NO_TORCH_NPU, reason="torch_npu is installed in this environment")
def test_compat_layer_is_a_logged_no_op_without_npu(caplog):
    with caplog.at_level(logging.INFO, logger="pytest_npu_parity.npu"):
        assert npu.register_transfer_to_npu() is False
        assert npu.set_npu_options() is False
    assert "transfer_to_npu not registered: torch_npu is not installed" in caplog.text
    assert "NPU options not set: torch_npu is not installed" in caplog.text
    with pytest.raises(RuntimeError, match="cannot bind an NPU: torch_npu is not installed"):
        npu.bind_device(0, device_type="npu")
    assert "npu.conv.allow_hf32" not in npu.precision_flags()


def test_bind_device_cpu_and_bad_arguments():
    assert npu.bind_device(3, device_type="cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="local_rank must be an int >= 0"):
        npu.bind_device(-1)
    with pytest.raises(ValueError, match="device_type must be 'npu', 'cuda' or 'cpu'"):
        npu.bind_device(0, device_type="tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")
def test_bind_device_auto_without_accelerators_is_cpu():
    assert npu.bind_device(0) == torch.device("cpu")


@pytest.mark.parametrize("device, backend", [
    (torch.device("cpu"), "gloo"), ("cpu", "gloo"), (torch.device("cuda", 1), "nccl"),
    ("cuda:1", "nccl"), ("npu:3", "hccl"), ("npu", "hccl"),
])
def test_dist_backend_for(device, backend):
    assert npu.dist_backend_for(device) == backend


@pytest.mark.parametrize("device", [torch.device("meta"), "xla:0", "npu cuda", 3])
def test_dist_backend_for_rejects_unknown(device):
    with pytest.raises(ValueError):
        npu.dist_backend_for(device)


def test_precision_flags_read_live_values():
    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        assert npu.precision_flags()["cuda.matmul.allow_tf32"] is True
        torch.backends.cuda.matmul.allow_tf32 = False
        assert npu.precision_flags()["cuda.matmul.allow_tf32"] is False
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    assert npu.precision_flags()["float32_matmul_precision"] == torch.get_float32_matmul_precision()


# --------------------------------------------------------------------------------------------
# probe_ops
# --------------------------------------------------------------------------------------------

def test_probe_ops_on_cpu_runs_every_op():
    probes = npu.probe_ops("cpu")
    assert list(probes) == list(npu.REQUIRED_OPS + npu.OPTIONAL_OPS)
    for name, probe in probes.items():
        assert probe.ok and probe.ran and probe.error is None, name
        assert probe.max_abs_diff == 0.0 and probe.output_device == "cpu"
    assert npu.needs_fft_fallback("cpu") is False


def test_probe_ops_reports_an_op_that_cannot_leave_the_device():
    # meta tensors run every op but cannot be copied back to the host
    (probe,) = npu.probe_ops("meta", ["linear"]).values()
    assert (probe.ok, probe.ran, probe.output_device) == (False, False, None)
    assert probe.error


def test_probe_ops_catches_a_wrong_result(monkeypatch):
    counter = itertools.count(1)
    wrong = npu.OpSpec("scaled", lambda g: (torch.randn(4, 4, generator=g),),
                       lambda x: x * next(counter), 1e-3, 1e-3, "reference ×1, target ×2")
    monkeypatch.setattr(npu_ops, "_op_specs", lambda: {"scaled": wrong})
    probe = npu.probe_ops("cpu", ["scaled"])["scaled"]
    assert probe.ran and not probe.ok
    assert "beyond rtol=0.001, atol=0.001" in probe.error
    assert probe.max_abs_diff > 0.1


def test_probe_ops_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown op probe\\(s\\) fftn; known: linear"):
        npu.probe_ops("cpu", ["linear", "fftn"])


# --------------------------------------------------------------------------------------------
# The stub torch_npu in a subprocess
# --------------------------------------------------------------------------------------------

STATUS_SNIPPET = """
import dataclasses, json, sys
from pytest_npu_parity import npu
status = npu.npu_status()
torch_npu_imported = "torch_npu" in sys.modules  # by npu_status (before any plain import torch)
import torch  # must still work whatever torch_npu did
print(json.dumps({"status": dataclasses.asdict(status), "torch_ok": bool(torch.ones(2).sum() == 2),
                  "torch_npu_imported": torch_npu_imported}))
"""


def _status(env) -> dict:
    proc = fake_env.run_python(STATUS_SNIPPET, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["torch_ok"] is True
    return result


def test_stub_ok_compat_layer(tmp_path):
    site = fake_env.build_site(tmp_path / "site", version=f"{TORCH_BASE}.post1")
    code = """
import json, torch
from pytest_npu_parity import npu
status = npu.npu_status()
import torch_npu.npu as stub
out = {"status": [status.available, status.reason, status.torch_npu_version, status.cann_version,
                  status.device_count, status.device_name],
       "transfer": npu.register_transfer_to_npu(),
       "transfer_module": "torch_npu.contrib.transfer_to_npu" in __import__("sys").modules,
       "options": npu.set_npu_options(),
       "bound": str(npu.bind_device(1)),
       "flags": npu.precision_flags(),
       "backend": npu.dist_backend_for(torch.device("npu", 0)),
       "fft_fallback": npu.needs_fft_fallback("npu:0"),
       "probe": [npu.probe_ops("npu:0", ["linear"])["linear"].ran],
       "calls": stub.CALLS}
try:
    npu.bind_device(2)
except ValueError as exc:
    out["bind_error"] = str(exc)
print(json.dumps(out))
"""
    env = fake_env.fake_env(site=site, toolkit=fake_env.TOOLKIT_HOME, FAKE_NPU_DEVICE_COUNT="2",
                            ASCEND_RT_VISIBLE_DEVICES="0,1")
    proc = fake_env.run_python(code, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["status"] == [True, None, f"{TORCH_BASE}.post1", "8.2.RC1", 2, "Ascend910B3"]
    assert out["transfer"] is True and out["transfer_module"] is True
    assert out["options"] is True
    assert out["bound"] == "npu:1"
    assert ["set_compile_mode", False] in out["calls"] and ["set_device", 1] in out["calls"]
    assert out["flags"]["npu.conv.allow_hf32"] is True          # torch_npu default (docs/explanation/findings.md)
    assert out["flags"]["npu.matmul.allow_hf32"] is False
    assert out["backend"] == "hccl"
    assert out["fft_fallback"] is True   # the stub cannot allocate on "npu": no FFT there either
    assert out["probe"] == [False]
    assert "local_rank 2 but only 2 npu device(s)" in out["bind_error"]
    assert "ASCEND_RT_VISIBLE_DEVICES=0,1" in out["bind_error"]


def test_stub_libhccl_with_autoload(tmp_path):
    site = fake_env.build_site(tmp_path / "site", version=TORCH_BASE)
    env = fake_env.fake_env(site=site, toolkit=fake_env.TOOLKIT_HOME, FAKE_TORCH_NPU_MODE="libhccl")
    result = _status(env)
    assert result["status"]["available"] is False
    assert result["status"]["reason"] == (
        f"Failed to load the backend extension: torch_npu (libhccl.so not found) — {SET_ENV}, or "
        "set TORCH_DEVICE_BACKEND_AUTOLOAD=0 to use torch without the NPU")
    assert result["status"]["torch_npu_version"] == TORCH_BASE
    assert result["status"]["cann_version"] == "8.2.RC1"


def test_stub_libhccl_without_autoload(tmp_path):
    site = fake_env.build_site(tmp_path / "site", version=TORCH_BASE)
    env = fake_env.fake_env(site=site, toolkit=fake_env.TOOLKIT_HOME, FAKE_TORCH_NPU_MODE="libhccl",
                            TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert _status(env)["status"]["reason"] == (
        f"torch_npu is not importable: libhccl.so not found — {SET_ENV}")


def test_stub_libhccl_and_cann_missing(tmp_path):
    site = fake_env.build_site(tmp_path / "site", version=TORCH_BASE, autoload=False)
    env = fake_env.fake_env(site=site, FAKE_TORCH_NPU_MODE="libhccl")
    reason = _status(env)["status"]["reason"]
    assert reason.startswith("torch_npu is not importable: libhccl.so not found and no CANN "
                             "toolkit under $ASCEND_TOOLKIT_HOME")
    documented = sorted({r.cann for r in npu.documented_rows(torch_npu=TORCH_BASE)})  # 8.1.RC1, 8.2.RC1 on 2.5.1
    want = f" {' or '.join(documented)}" if documented else ""
    assert reason.endswith(f"install the CANN toolkit{want} matching torch_npu and {NO_CANN_SET_ENV}")


def test_plain_import_torch_with_broken_torch_npu_is_explained(tmp_path):
    site = fake_env.build_site(tmp_path / "site", version=TORCH_BASE)
    code = """
from pytest_npu_parity.npu import explain_import_error
try:
    import torch
except Exception as exc:
    print(explain_import_error(exc))
else:
    print("import torch did not fail")
"""
    proc = fake_env.run_python(code, env=fake_env.fake_env(site=site, FAKE_TORCH_NPU_MODE="libhccl"))
    assert proc.stdout.strip() == (
        f"Failed to load the backend extension: torch_npu (libhccl.so not found) — {NO_CANN_SET_ENV}, or "
        "set TORCH_DEVICE_BACKEND_AUTOLOAD=0 to use torch without the NPU")


@pytest.mark.parametrize("mode, start", [
    # the stub's metadata pins a torch release, so the fix names what the installed wheel pins
    ("two_accelerators_cuda", "Two accelerators cannot be used at the same time: torch_npu is "
                              "installed beside a CUDA build of torch — torch_npu "),
    ("two_accelerators_npu", "Two accelerators cannot be used at the same time: torch_npu was "
                             "registered twice"),
])
def test_stub_two_accelerators(tmp_path, mode, start):
    # "npu and npu" is the 2.5.1 wheel's (2.14.0's _check_device_conflict accepts npu)
    site = fake_env.build_site(tmp_path / "site", version=TORCH_BASE, generation="2.5")
    result = _status(fake_env.fake_env(site=site, FAKE_TORCH_NPU_MODE=mode))
    assert result["status"]["reason"].startswith(start)


def test_stub_version_mismatch_is_judged_without_importing(tmp_path):
    site = fake_env.build_site(tmp_path / "site", version="1.11.0.post14")
    result = _status(fake_env.fake_env(site=site, toolkit=fake_env.TOOLKIT_HOME))
    assert result["status"]["reason"].startswith(
        f"torch_npu 1.11.0.post14 is built for torch 1.11.0, but torch "
        f"{importlib.metadata.version('torch')} is installed — install torch 1.11.0")
    assert result["torch_npu_imported"] is False


# --------------------------------------------------------------------------------------------
# The launcher (seed §4.2): transfer_to_npu, compile mode, set_device — before `import aurora`
# --------------------------------------------------------------------------------------------

#: What every process that imports aurora on an NPU target must have done first, in this order.
LAUNCH_ORDER = ["transfer_to_npu", "set_compile_mode", "set_device"]
#: The suite's fixture paths to aurora, one test each: the `aurora` fixture (full model), the
#: `aurora_tiny` fixture (training step) and the device-propagation tests' own tiny model.
FIXTURE_PATHS = {
    "parity_suites/aurora/test_model.py::test_model[fp16-aurora_model]": "aurora",
    "parity_suites/aurora/test_train_step.py::test_train_step[fp16]": "aurora_tiny",
    "parity_suites/aurora/test_device_propagation.py::test_attention": "tiny",
}


def _events(log: Path) -> dict[int, list[dict]]:
    """The stub's event log (tests/fakes/torch_npu_stub/torch_npu/_events.py) per process, in order."""
    per_pid: dict[int, list[dict]] = {}
    for line in log.read_text(encoding="utf-8").splitlines():
        event = json.loads(line)
        per_pid.setdefault(event["pid"], []).append(event)
    return per_pid


def _assert_launched_before_aurora(per_pid: dict[int, list[dict]]) -> list[dict]:
    """Every process that imported aurora did exactly the launcher steps first, in the guide's order;
    returns the import events."""
    imports = []
    for pid, events in per_pid.items():
        names = [e["event"] for e in events]
        if "import aurora" not in names:
            continue
        first = names.index("import aurora")
        assert names[:first] == LAUNCH_ORDER, (pid, names)
        assert events[1]["jit_compile"] is False
        imports += [e for e in events if e["event"] == "import aurora"]
    assert imports, per_pid
    return imports


def test_launch_does_nothing_for_a_cpu_or_cuda_target(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a launcher step ran for a CPU/CUDA target")

    for name in ("register_transfer_to_npu", "set_npu_options", "bind_device", "npu_status"):
        monkeypatch.setattr(npu_launcher, name, forbidden)
    assert npu.launch(torch.device("cpu")) is None
    assert npu.launch("cuda:1") is None
    assert npu.launched() is None
    assert npu.fp16_warning("cpu", ["fp16"]) is None and npu.fp16_warning("cuda:0", ["fp32", "fp16"]) is None


def test_fp16_warning_quotes_the_guide_on_an_npu():
    assert npu.fp16_warning("npu:0", ["fp32", "bf16"]) is None
    text = npu.fp16_warning("npu:1", ["fp32", "fp16"])
    assert text == npu.FP16_NPU_WARNING and text.startswith("WARNING [NPU] fp16")
    assert "bf16 natively and needs no loss scaling" in text and "--parity-dtypes bf16" in text


def test_stub_launch_order_idempotence_and_rebinding(tmp_path):
    site = fake_env.build_site(tmp_path / "site", version=TORCH_BASE)
    log = tmp_path / "events.jsonl"
    code = """
import json
from pytest_npu_parity import npu
first = npu.launch("npu:1")
again = npu.launch("npu:1")
other = npu.launch("npu:0")
print(json.dumps({"first": [first.device, list(first.steps)], "same": again is first,
                  "other": [other.device, list(other.steps)], "describe": first.describe()}))
"""
    env = fake_env.fake_env(site=site, toolkit=fake_env.TOOLKIT_HOME, event_log=log, FAKE_NPU_DEVICE_COUNT="2")
    proc = fake_env.run_python(code, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    steps = ["transfer_to_npu", "set_compile_mode(jit_compile=False)", "set_device(1)"]
    assert out["first"] == ["npu:1", steps] and out["same"] is True
    assert out["other"] == ["npu:0", steps + ["set_device(0)"]]
    assert out["describe"] == " → ".join(steps)
    [events] = _events(log).values()
    assert [(e["event"], e.get("index", e.get("jit_compile"))) for e in events] == [
        ("transfer_to_npu", None), ("set_compile_mode", False), ("set_device", 1), ("set_device", 0)]


def test_stub_launch_after_import_aurora_is_refused_and_the_plugin_says_why(tmp_path):
    site = fake_env.build_site(tmp_path / "site", version=TORCH_BASE)
    env = fake_env.fake_env(site=site, toolkit=fake_env.TOOLKIT_HOME)
    # An import of aurora that came too early, as a bare module in sys.modules (what the guard
    # looks at), so that no test pays for importing transformers here.
    early = "import sys, types\nsys.modules['aurora'] = types.ModuleType('aurora')\n"
    code = early + """
from pytest_npu_parity import npu
try:
    npu.launch("npu:0")
except npu.LaunchOrderError as exc:
    print("refused:", exc)
"""
    proc = fake_env.run_python(code, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("refused: aurora was imported before the NPU launcher steps (transfer_to_npu, "
                                  "compile mode, set_device)")
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(early, encoding="utf-8")  # a conftest importing aurora at its top
    (suite / "test_x.py").write_text("def test_x(parity):\n    pass\n", encoding="utf-8")
    proc = fake_env.run_python(args=["-m", "pytest", "-p", "no:cacheprovider", "--npu-parity",
                                     "--parity-device", "npu", str(suite)], env=env)
    assert proc.returncode == 4, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "--parity-device=npu:0: aurora was imported before the NPU launcher steps" in proc.stderr
    assert "import aurora inside a fixture or function" in proc.stderr


def test_stub_plugin_launches_in_every_xdist_worker_before_any_fixture_imports_aurora(tmp_path):
    """pytest -n 2 on a 2-NPU stub: each worker binds its own NPU after transfer_to_npu and the compile
    mode, the controller binds none, and each of the suite's paths to aurora comes after."""
    site = fake_env.build_site(tmp_path / "site", version=TORCH_BASE)
    log = tmp_path / "events.jsonl"
    env = fake_env.fake_env(site=site, toolkit=fake_env.TOOLKIT_HOME, event_log=log, FAKE_NPU_DEVICE_COUNT="2",
                            FAKE_BLOCK_AURORA_IMPORT="1")  # stop each fixture at its import: no model is built
    proc = fake_env.run_python(args=["-m", "pytest", "-p", "no:cacheprovider", "--npu-parity", "--parity-device",
                                     "npu", "--parity-dtypes", "fp16", "-n", "2", *FIXTURE_PATHS], env=env)
    per_pid = _events(log)
    imports = _assert_launched_before_aurora(per_pid)
    assert {e["test"].split(" ")[0] for e in imports} == set(FIXTURE_PATHS), imports
    bound = {pid: [e["index"] for e in events if e["event"] == "set_device"] for pid, events in per_pid.items()}
    assert sorted(bound.values()) == [[0], [1]]  # two workers, one NPU each; the controller bound nothing
    assert "blocked by the test's import hook" in proc.stdout  # the fixtures did reach `import aurora`
    assert f"npu-parity: {npu.FP16_NPU_WARNING}" in proc.stdout  # the header (controller)
    assert "launcher (before any import of aurora): in every xdist worker" in proc.stdout


def test_stub_data_parallel_ranks_launch_before_their_model_imports_aurora(tmp_path):
    site = fake_env.build_site(tmp_path / "site", version=TORCH_BASE)
    log = tmp_path / "events.jsonl"
    code = """
import functools
from pytest_npu_parity import distributed, npu
from pytest_npu_parity.aurora import checks, factory
npu.launch("npu:0")  # the parent, as the plugin does at session start
batch = checks.suite_batch().forward_kwargs(checks.HORIZON, train=True)
try:
    distributed.data_parallel_step(functools.partial(factory.get_model, "tiny", seed=0), batch, world_size=2,
                                   device="npu:0", device_count=2, timeout_s=240, threads=1)
except distributed.DataParallelError as exc:  # the stub cannot place the model on "npu"
    print("ranks stopped:", str(exc).splitlines()[0])
"""
    env = fake_env.fake_env(site=site, toolkit=fake_env.TOOLKIT_HOME, event_log=log, FAKE_NPU_DEVICE_COUNT="2",
                            FAKE_NPU_HCCL="gloo")
    proc = fake_env.run_python(code, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ranks stopped: data-parallel step: rank" in proc.stdout
    per_pid = _events(log)
    imports = _assert_launched_before_aurora(per_pid)
    bound = sorted(e["index"] for events in per_pid.values() for e in events if e["event"] == "set_device")
    assert len(per_pid) == len(imports) == 3 and bound == [0, 0, 1]  # the parent on npu:0, rank r on npu:r


def test_stub_doctor_launches_before_its_aurora_sections(tmp_path):
    site = fake_env.build_site(tmp_path / "site", version=TORCH_BASE)
    log = tmp_path / "events.jsonl"
    env = fake_env.fake_env(site=site, toolkit=fake_env.TOOLKIT_HOME, event_log=log, FAKE_NPU_DEVICE_COUNT="2")
    proc = fake_env.run_python(args=["-m", "pytest_npu_parity", "doctor", "--device", "npu:1", "--json",
                                     "--skip", "distributed", "--skip", "deepspeed"], env=env)
    report = json.loads(proc.stdout)
    devices = next(s for s in report["sections"] if s["name"] == "devices")
    assert devices["data"]["launch"] == {"device": "npu:1", "steps": [
        "transfer_to_npu", "set_compile_mode(jit_compile=False)", "set_device(1)"]}
    assert ("launcher (before any import of aurora): transfer_to_npu → set_compile_mode(jit_compile=False) → "
            "set_device(1)") in devices["details"]
    imports = _assert_launched_before_aurora(_events(log))
    assert len(imports) == 1  # the patch-set / smoke sections


AARCH64_WHEELS = TESTS / "data" / "torch_npu_aarch64"  # METADATA/WHEEL of the real aarch64 wheels


@pytest.mark.parametrize(("wheel", "pin", "fix"), [
    # the aarch64 2.5.1 wheel pins plain torch ==2.5.1 (its x86_64 twin pins 2.5.1+cpu)
    ("2.5.1", "2.5.1", "torch_npu 2.5.1 accepts this build (it pins torch==2.5.1) but refuses to load where a CUDA "
                       "device is visible: hide the GPUs from this process (`export CUDA_VISIBLE_DEVICES=`) or install "
                       "`pip install torch==2.5.1 --index-url https://download.pytorch.org/whl/cpu` (aarch64;"),
    ("2.14.0", "2.14.0.*", "or install `pip install torch==2.14.0 --index-url https://download.pytorch.org/whl/cpu` "
                           "(aarch64;"),
])
def test_two_accelerators_fix_from_the_real_aarch64_wheels_metadata(monkeypatch, tmp_path, wheel, pin, fix):
    dist = tmp_path / f"torch_npu-{wheel}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text((AARCH64_WHEELS / f"METADATA-{wheel}").read_text(encoding="utf-8"), encoding="utf-8")
    (dist / "WHEEL").write_text("Wheel-Version: 1.0\n" + (AARCH64_WHEELS / f"WHEEL-{wheel}").read_text(encoding="utf-8"),
                                encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))  # found before any installed torch_npu
    assert npu._torch_pin_of_torch_npu() == (wheel, pin)
    sentence = npu._cpu_build_fix(arm=True)
    assert fix in sentence and "+cpu" not in sentence, sentence
    assert "+cpu" in npu._cpu_build_fix(arm=False)  # the same wheel on an x86_64 host: the +cpu build
